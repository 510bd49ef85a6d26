"""Every `MINFER_*` environment variable minfer reads, in one place (docs/configuration.md).

Nothing else in the package reads the environment for minfer's own settings; each module asks
here. The module imports only the standard library, so any layer may use it. An unset or empty
variable is the default; a malformed value is refused by name where it is parsed.

| variable | read by | meaning |
| --- | --- | --- |
| MINFER_HOME | store, jit_cache | the cache folder (models, compiled kernels); ~/.cache/minfer |
| MINFER_CATALOG | store | a catalogue JSON in place of the built-in one |
| MINFER_BACKEND | backends.select | auto / cpu / torch when no --backend is given |
| MINFER_THREADS | engine.config | thread count when none is given (else every usable core) |
| MINFER_PROFILE | engine.forward | any value: seconds per op:role of every forward (and image) |
| MINFER_TRACE | engine.trace | a file: every Engine of the process records a trace written there |
| MINFER_TRACE_STEPS | engine.trace | steps the trace keeps (512) |
| MINFER_SHARE_WEIGHTS | engine.shared_weights | 0: no file-backed repacked weights; a folder |
| MINFER_TORCH_DEVICE, _CLAIM, _WEIGHTS, _MIN_ROWS | backends.torch_backend | the torch backend |
| MINFER_ENCODER_F32 | backends.cpu | any value: encoders keep the f32 GEMM (not AMX, not int16) |
| MINFER_ENCODER_INT8 | backends.cpu | any value: encoders without AMX use the int8 dots |
| MINFER_IQ_WIDEN | backends.cpu.kernels.quant | any value: READ_DIRECT i-quants widened (speed) |
| MINFER_REGIONS | backends.cpu.regions | 0: each tape step its own call (no parallel regions) |
| MINFER_API_KEY | cli serve | the server's API key when --api-key is not given |
| MINFER_TIMING | cli run | any value: per-phase timings on stderr |
"""

from __future__ import annotations

import os


def get(name: str, default: str = "") -> str:
    """The variable's value, stripped (default when unset or empty)."""
    if not name.startswith("MINFER_"):
        raise ValueError(f"{name} is not one of minfer's variables")
    return os.environ.get(name, "").strip() or default


def flag(name: str) -> bool:
    """Set to anything non-empty."""
    return bool(get(name))


def threads() -> int | None:
    """MINFER_THREADS as a positive count, None when unset."""
    value = get("MINFER_THREADS")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        from minfer.errors import MinferError

        raise MinferError(f"MINFER_THREADS={value!r} is not a positive integer")
    return int(value)
