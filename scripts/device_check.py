"""One prepared check of the torch backend on a GPU machine (no network, no dev model needed).

    .venv/bin/python scripts/device_check.py               # on the GPU machine (device cuda)
    .venv/bin/python scripts/device_check.py --device cpu  # dry run of the same path on a CPU

It writes a random-weight model in Qwen2.5-0.5B's shapes (`write_model_like_qwen25_05b`, ~0.5 GB,
about 10-30 s; `--layers N` writes fewer layers of the same shapes), then:

1. agreement: last-row logits of a prefill (and a few decode steps) on the torch backend on the
   device vs the CPU backend, next to torch on the host CPU (same bf16 math, zero-copy) as the
   noise floor: max |diff| relative to the largest logit, top-1 equal. Random weights have
   near-ties, so the pass rule is "the device adds nothing beyond bf16's own noise";
2. speed: prefill of `--prompt` tokens (best of `--reps`) and decode tokens/s for the CPU
   kernels, torch on the host CPU (AMX there?) and torch on the device;
3. the copies: crossings per forward and host<->device copies actually made.

With `--device cpu` the torch backend runs on the host but through the copying I/O path
(`force_copies`), so the code that runs on CUDA is exercised here. Prints a short report and,
when `$OUT` is set, writes it to `$OUT/device_check.json` too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def write_model(path: Path, layers: int) -> Path:
    from minfer.tools import synth

    if layers == 24:
        return synth.write_model_like_qwen25_05b(path)
    return synth.write_tiny_model(  # the same shapes, fewer layers (a quicker check)
        path, arch="qwen2", n_layer=layers, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864,
        vocab=synth.build_tiny_vocab(vocab_size=151936), weight_types=synth.QWEN25_05B_TYPES,
        tied=False, n_ctx_train=32768, rope_base=1000000.0)


def make_engines(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """cpu: the compiled kernels; host: torch on the host CPU, zero-copy (the bf16 noise floor);
    device: torch on `args.device` through the copying I/O (forced on a CPU dry run)."""
    from minfer.backends.cpu.backend import CpuBackend
    from minfer.backends.torch_backend.backend import TorchBackend
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile

    f = GGUFFile.open(path)
    hp = HParams.from_gguf(f)
    n_ctx = args.prompt + args.decode + 8
    device = TorchBackend(device=args.device, claim="dense", weights="bf16",
                          min_rows=args.min_rows, force_copies=args.device == "cpu")
    host = TorchBackend(device="cpu", claim="dense", weights="bf16", min_rows=args.min_rows)

    def engine(*backends: Any) -> Engine:
        return Engine(f, hp, n_ctx=n_ctx, backends=[*backends, CpuBackend()],
                      n_threads=args.threads)

    return {"cpu": engine(), "host": engine(host), "device": engine(device), "backend": device}


def agreement(engines: dict[str, Any], tokens: list[int], n_decode: int) -> dict[str, Any]:
    """Last-row logits of the prefill and of a few decode steps (all fed the CPU's greedy
    tokens), as max |diff| relative to the largest |logit|."""
    rows: dict[str, np.ndarray] = {}
    for name in ("cpu", "host", "device"):
        e = engines[name]
        seq = [e.forward(tokens, 0)[0]]
        for i in range(n_decode):
            nxt = int(np.argmax(rows["cpu"][i] if name != "cpu" else seq[-1]))
            seq.append(e.forward([nxt], len(tokens) + i)[0])
        rows[name] = np.stack(seq)

    def rel(a: str, b: str, sl: slice) -> float:
        return float(np.abs(rows[a][sl] - rows[b][sl]).max() / np.abs(rows[b][sl]).max())

    pre, dec = slice(0, 1), slice(1, None)
    return {
        "prefill_rel_device_vs_cpu": rel("device", "cpu", pre),
        "prefill_rel_host_vs_cpu": rel("host", "cpu", pre),  # bf16's own noise
        "prefill_rel_device_vs_host": rel("device", "host", pre),
        "prefill_top1_device_eq_cpu": bool(rows["device"][0].argmax() == rows["cpu"][0].argmax()),
        "decode_rel_device_vs_cpu": rel("device", "cpu", dec) if n_decode else 0.0,
        "decode_top1_equal": int((rows["device"][1:].argmax(1) == rows["cpu"][1:].argmax(1)).sum()),
    }


def speed(engine: Any, tokens: list[int], n_decode: int, reps: int) -> dict[str, float]:
    engine.forward(tokens, 0)  # warm-up: compiles, resident weights, CUDA context
    best = min(_timed(lambda: engine.forward(tokens, 0)) for _ in range(reps))
    t0 = time.perf_counter()
    for i in range(n_decode):
        engine.forward([tokens[i % len(tokens)]], len(tokens) + i)
    decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(tokens) / best, "decode_tok_s": n_decode / decode_s}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copies(engines: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    from minfer.graph import scheduler

    e = engines["device"]
    prepared = e.cache.get(e.params_for(n_tokens, 1))
    io = engines["backend"].io
    return {
        "backend": engines["backend"].describe(),
        "crossings_per_prefill": scheduler.count_crossings(prepared.graph, prepared.plan.live),
        "splits_per_prefill": len(prepared.splits),
        "host_to_device_total": getattr(io, "host_to_device", 0),
        "device_to_host_total": getattr(io, "device_to_host", 0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 2, 16))
    p.add_argument("--min-rows", type=int, default=1, help="rows from which torch takes a node")
    p.add_argument("--model", type=Path, help="reuse a model file instead of writing one")
    args = p.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible; use --device cpu for a dry run", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": args.device, "torch_version": torch.__version__,
                              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda"
                              else "", "layers": args.layers, "prompt": args.prompt}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = args.model or write_model(Path(tmp) / "synth05b.gguf", args.layers)
        report["write_model_s"] = round(time.perf_counter() - t0, 1)
        engines = make_engines(path, args)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, engines["cpu"].hparams.n_vocab, args.prompt).tolist()
        report["agreement"] = agreement(engines, tokens, min(args.decode, 4))
        for name in ("cpu", "host", "device"):
            report[f"speed_{name}"] = speed(engines[name], tokens, args.decode, args.reps)
        report["copies"] = copies(engines, args.prompt)
    report["prefill_speedup_device_vs_cpu"] = (report["speed_device"]["prefill_tok_s"]
                                               / report["speed_cpu"]["prefill_tok_s"])
    print(json.dumps(report, indent=2))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "device_check.json").write_text(json.dumps(report, indent=2))
    agree = report["agreement"]  # the device must add nothing beyond bf16's own noise
    ok = (agree["prefill_rel_device_vs_host"] < 0.02
          and agree["prefill_rel_device_vs_cpu"] < 2 * agree["prefill_rel_host_vs_cpu"] + 0.01)
    print("device check:", "OK" if ok else "MISMATCH", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
