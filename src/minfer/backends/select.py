"""Which backends a session uses: `--backend auto|cpu|torch` (or MINFER_BACKEND).

`cpu` is always present and takes every node the others decline. `torch` must be importable and
useful on this machine (AMX or CUDA); asking for it where it is not is an error, never a silent
switch. `auto` adds torch only where it is known to pay.
"""

from __future__ import annotations

from minfer import env
from minfer.backends.base import Backend
from minfer.backends.cpu.backend import CpuBackend
from minfer.errors import MinferError

CHOICES = ("auto", "cpu", "torch")


def select_backends(choice: str | None = None) -> list[Backend]:
    choice = (choice or env.get("MINFER_BACKEND") or "auto").lower()
    if choice not in CHOICES:
        raise MinferError(f"unknown backend {choice!r} (choose from {', '.join(CHOICES)})")
    backends: list[Backend] = []
    if choice in ("auto", "torch"):
        torch_backend = _torch_backend(required=choice == "torch")
        if torch_backend is not None:
            backends.append(torch_backend)
    backends.append(CpuBackend())
    return backends


def _torch_backend(*, required: bool) -> Backend | None:
    try:
        from minfer.backends.torch_backend import make_torch_backend
    except ImportError as exc:
        if required:
            raise MinferError(f"the torch backend is not available: {exc}") from None
        return None
    return make_torch_backend(required=required)
