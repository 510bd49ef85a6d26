"""What this machine offers torch: bf16 matrix units on the CPU, or a CUDA device.

The decision reads the CPU's flags (`/proc/cpuinfo`), never its model name: `amx_bf16` +
`amx_tile` (Intel AMX tiles) and `avx512_bf16` (the `vdpbf16ps` dot product, on Intel Cooper
Lake+ and AMD Zen 4+) both give oneDNN a native bf16 GEMM several times the f32 rate; without
either, bf16 is emulated and loses to the compiled quantized kernels. `auto` takes torch only
with AMX tiles or a CUDA device, as the backend's issue asks; on AVX512-BF16 alone (measured on
this project's AMD machines: pp512 ≈ 2.2x llama.cpp, 3x the CPU backend, at +300 MB RSS) torch
runs when asked for with `--backend torch`.

Threads: numba owns them (interfaces.md). torch's intra-op pool is sized to numba's count before
each forward torch takes part in, and its inter-op pool to one thread. numba's `omp` layer links
the system libgomp and the torch wheel ships its own, so the process holds two OpenMP pools
(3 threads at n=2) that take turns in the scheduler's walk. Measured on 2 cores (0.5B, pp256,
torch taking matmuls only, i.e. the most alternation; `benchmarks/torch_prefill.py
--threads-check`): default 532 tok/s, OMP_WAIT_POLICY=passive 520, NUMBA_THREADING_LAYER=
workqueue 489 (5 threads): no oversubscription, so the defaults stay. Where other busy processes
share the cores, spinning OpenMP waiters cost torch dearly (bf16 pp512 770 -> 240 tok/s next to
one busy process); OMP_WAIT_POLICY=passive in the environment recovers 420 (at -9 % on an idle
machine), and one torch thread gives ~420 either way. The user chooses; nothing here sets it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from minfer import env

CPUINFO = Path("/proc/cpuinfo")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Capabilities:
    """What torch could use here; `torch_ok` is False when torch itself is missing."""

    torch_ok: bool
    amx: bool  # amx_bf16 and amx_tile
    avx512_bf16: bool
    cuda: bool
    cuda_name: str = ""

    @property
    def cpu_bf16(self) -> bool:
        """A native bf16 GEMM on this CPU (AMX tiles or AVX512-BF16 dot products)."""
        return self.amx or self.avx512_bf16

    def describe(self) -> str:
        cpu = "amx" if self.amx else "avx512_bf16" if self.avx512_bf16 else "no native bf16"
        gpu = f"cuda ({self.cuda_name})" if self.cuda else "no cuda"
        return f"cpu: {cpu}; {gpu}"


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's `flags` line as a set (empty when the file is unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def detect(cpuinfo: Path = CPUINFO) -> Capabilities:
    flags = cpu_flags(cpuinfo)
    amx = {"amx_bf16", "amx_tile"} <= flags
    avx512_bf16 = "avx512_bf16" in flags
    try:
        import torch
    except ImportError:
        return Capabilities(False, amx, avx512_bf16, cuda=False)
    cuda = bool(torch.cuda.is_available())
    name = torch.cuda.get_device_name(0) if cuda else ""
    return Capabilities(True, amx, avx512_bf16, cuda=cuda, cuda_name=name)


# device nodes of a GPU torch could drive (NVIDIA's driver; AMD's ROCm)
GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd")


def worth_probing(cpuinfo: Path = CPUINFO, gpu_nodes: tuple[str, ...] = GPU_NODES) -> bool:
    """Whether `auto` could choose torch here, judged without importing it: a CPU with AMX
    bf16 tiles, or a GPU's device node. Elsewhere `auto` never imports torch."""
    flags = cpu_flags(cpuinfo)
    return {"amx_bf16", "amx_tile"} <= flags or gpu_present(gpu_nodes)


def gpu_present(gpu_nodes: tuple[str, ...] = GPU_NODES) -> bool:
    """Whether a GPU's device node exists (torch would have to be asked about CUDA)."""
    return any(Path(p).exists() for p in gpu_nodes)


def choose_device(caps: Capabilities, wanted: str = "auto") -> str | None:
    """'cuda' where a GPU is present, else 'cpu' where the CPU has AMX bf16 tiles.

    `wanted` pins the device ('cpu' is always allowed when torch is present: tests and the
    dry run of scripts/device_check.py use it on any CPU). None means torch would not pay here.
    """
    if not caps.torch_ok:
        return None
    if wanted == "cuda":
        return "cuda" if caps.cuda else None
    if wanted == "cpu":
        return "cpu"
    if caps.cuda:
        return "cuda"
    return "cpu" if caps.amx else None


def numba_threads() -> int:
    """The thread count numba runs with now (the count the engine set)."""
    import numba

    return int(numba.get_num_threads())


def sync_threads(n_threads: int) -> None:
    """Size torch's intra-op pool like numba's; one inter-op thread (torch runs no graph)."""
    import torch

    if torch.get_num_threads() != n_threads:
        torch.set_num_threads(n_threads)
    if torch.get_num_interop_threads() != 1:
        with contextlib.suppress(RuntimeError):  # settable only before torch's first parallel work
            torch.set_num_interop_threads(1)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """An environment setting checked against its allowed values (loud on a typo)."""
    from minfer.errors import MinferError

    value = env.get(name, default).lower() or default
    if value not in choices:
        raise MinferError(f"{name}={value!r}: choose from {', '.join(choices)}")
    return value
