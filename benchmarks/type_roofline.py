"""Decode speed of every weight type minfer reads, against the read bandwidth and llama.cpp.

Not part of the test suite. Issue #65 asks decode of every type at >= 75% of the read bandwidth
of its bytes; this makes that table. Each type's file is the development model requantized by
llama.cpp's own `llama-quantize --allow-requantize --pure` (`--imatrix` for the 1-3 bit
i-quants; the imatrix is made once by `llama-imatrix -c 128` on tests/fixtures/
kv_long_prompt.txt), cached in `--cache` and made when missing. Requantizing a quantized file is
what is at hand: the figures measure speed, not quality. `--pure` keeps every matrix in the
type except where llama-quantize cannot: a type of 256-value blocks falls back (to IQ4_NL, Q4_0,
Q5_0, Q5_1 or Q8_0) on matrices whose rows are not a multiple of 256 (the 0.5B's 896-wide
ones), and the imatrix types keep output.weight and the token embedding in Q4_K (llama-imatrix
has no statistics for the output matrix, and ggml refuses the 1-2 bit types without them), so
the table gives the share of each file's bytes per token that are the type.

Per type, alternating minfer / llama.cpp for `--rounds` rounds (`vs_llamacpp.py`'s runners and
its page-cache eviction before each run): tg tokens/s (`-n`, `-r` reps), the bytes a decode
step reads (`minfer.bench.runner.weight_bytes_per_token`: every weight tensor once, a tied
embedding counted once as the output matmul, plus the token's embedding row), the effective
bandwidth bytes x tok/s, and its fraction of `minfer bench --roofline`'s read bandwidth
(`minfer.bench.bandwidth.read_bandwidth`, read before each type's runs). Where minfer widens a
type for its kernels (`reencode.widen`: Q3_K, IQ3/IQ2/IQ1, TQ2_0 to Q6_K / Q7_K copies) it reads
more bytes than the file's: the table gives both fractions, "of its bytes" (the file's, the
issue's measure) and "of the bytes read" (what minfer holds, `held_bytes_per_token`).

    .venv/bin/python benchmarks/type_roofline.py --json /tmp/type_roofline.json
    .venv/bin/python benchmarks/type_roofline.py --types Q4_0,Q4_K,IQ2_XS --rounds 1
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fresh_pages import drop_pages, model_files
from vs_llamacpp import LLAMA_SCRIPT, MINFER_SCRIPT, run_one

# the table's name → (llama-quantize's type argument, whether it gets the imatrix)
TYPES: dict[str, tuple[str, bool]] = {
    "F16": ("F16", False), "BF16": ("BF16", False), "Q8_0": ("Q8_0", False),
    "Q4_0": ("Q4_0", False), "Q4_1": ("Q4_1", False), "Q5_0": ("Q5_0", False),
    "Q5_1": ("Q5_1", False), "Q2_K": ("Q2_K", False), "Q3_K": ("Q3_K", False),
    "Q4_K": ("Q4_K", False), "Q5_K": ("Q5_K", False), "Q6_K": ("Q6_K", False),
    "IQ4_NL": ("IQ4_NL", False), "IQ4_XS": ("IQ4_XS", False), "IQ3_S": ("IQ3_S", True),
    # (llama-quantize's IQ2_S file type is IQ2_XS tensors at its default; IQ2_M's is IQ2_S)
    "IQ3_XXS": ("IQ3_XXS", True), "IQ2_S": ("IQ2_M", True), "IQ2_XS": ("IQ2_XS", True),
    "IQ2_XXS": ("IQ2_XXS", True), "IQ1_M": ("IQ1_M", True), "IQ1_S": ("IQ1_S", True),
    "TQ1_0": ("TQ1_0", False), "TQ2_0": ("TQ2_0", False),
    # llama-quantize has no plain MXFP4 file type; MXFP4_MOE with --pure makes every matrix
    # MXFP4 (without --pure only MoE experts would be)
    "MXFP4": ("MXFP4_MOE", False),
}
GOAL = 0.75  # issue #65: decode at >= 75% of the read bandwidth of its bytes
IMATRIX_TEXT = Path(__file__).resolve().parent.parent / "tests/fixtures/kv_long_prompt.txt"


SIMD_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile")


def cpu_name() -> str:
    """`lscpu`'s model name, and which of SIMD_FLAGS it lists (a KVM guest's model name can be
    as bare as "Intel(R) Xeon(R) Processor")."""
    fields = dict(line.split(":", 1) for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
        if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return (f"{fields.get('Model name', 'unknown CPU').strip()} "
            f"({' '.join(f for f in SIMD_FLAGS if f in flags) or 'no AVX2'})")


def default_cache(source: Path) -> Path:
    """~/.cache/minfer/qtypes-<the source's size label>, e.g. qtypes-0.5b."""
    size = re.search(r"\d+(?:\.\d+)?[bm](?=[-_.])", source.name.lower())
    return Path.home() / ".cache/minfer" / f"qtypes-{size.group(0) if size else source.stem}"


def _tool(bin_dir: Path, name: str, args: list[str], log: Path) -> str | None:
    """Run llama.cpp's tool `name` at low priority; None, or why it failed (its log's tail)."""
    with log.open("w") as out:
        rc = subprocess.run(["nice", str(bin_dir / name), *args], stdout=out,
                            stderr=subprocess.STDOUT, check=False).returncode
    if rc == 0:
        return None
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return f"{name} exited {rc}: {' / '.join(tail[-2:])[-300:]}"


def make_files(names: list[str], source: Path, cache: Path,
               bin_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The quantized file of each type (made when missing, to a .part renamed when done), and
    the reasons of those that could not be made."""
    cache.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    imatrix = cache / "imatrix.gguf"
    for name in names:
        qtype, wants_imatrix = TYPES[name]
        path = cache / f"{name}.gguf"
        if not path.exists():
            if wants_imatrix and not imatrix.exists():
                print(f"making {imatrix} ...", file=sys.stderr, flush=True)
                part = cache / "imatrix.part.gguf"
                err = _tool(bin_dir, "llama-imatrix",
                            ["-m", str(source), "-f", str(IMATRIX_TEXT), "-c", "128", "-t", "2",
                             "-o", str(part)], cache / "imatrix.log")
                if err is not None:
                    raise RuntimeError(err)
                part.rename(imatrix)
            print(f"making {path} ...", file=sys.stderr, flush=True)
            part = cache / f"{name}.part.gguf"
            # llama-imatrix collects no statistics for output.weight, and ggml refuses the
            # 1-2 bit types there without them: those files keep the output matrix and the
            # token embedding in Q4_K (the table's "share of its bytes" column shows it)
            extra = (["--imatrix", str(imatrix), "--output-tensor-type", "q4_k",
                      "--token-embedding-type", "q4_k"] if wants_imatrix else [])
            err = _tool(bin_dir, "llama-quantize",
                        ["--allow-requantize", "--pure", *extra, str(source), str(part),
                         qtype, "2"], cache / f"{name}.log")
            if err is not None:
                part.unlink(missing_ok=True)
                skipped[name] = err
                continue
            part.rename(path)
        paths[name] = path
    return paths, skipped


def _type_mix(path: Path) -> str:
    """The file's tensor types, most common first ("Q5_0 133, F32 121, ...")."""
    from minfer.gguf import GGUFFile

    with GGUFFile.open(path) as f:
        return ", ".join(f"{t} {n}" for t, n in f.type_census().items())


def measure(name: str, path: Path, args: argparse.Namespace,
            read_bandwidth: Callable[..., float]) -> dict[str, Any] | str:
    """One type's row: `args.rounds` rounds, each a read-bandwidth probe, then minfer and
    llama.cpp (alternating which goes first) on fresh pages; or why minfer could not run it."""
    shape = [str(args.n_ctx), "0", str(args.n), str(args.reps), "0"]  # pp 0: tg only
    runs: dict[str, list[dict[str, Any]]] = {"minfer": [], "llama.cpp": []}
    failed: dict[str, str] = {}
    bandwidth = []
    for rnd in range(args.rounds):
        bandwidth.append(read_bandwidth(args.threads, passes=3))
        order = ["minfer", "llama.cpp"] if rnd % 2 == 0 else ["llama.cpp", "minfer"]
        for engine in (e for e in order if e not in failed):
            drop_pages(model_files(path))
            try:
                if engine == "minfer":
                    res = run_one(sys.executable, MINFER_SCRIPT,
                                  [str(path), str(args.threads), *shape, args.backend])
                else:
                    res = run_one(args.ref_python, LLAMA_SCRIPT,
                                  [str(path), str(args.threads), *shape])
            except RuntimeError as exc:
                failed[engine] = str(exc).strip().splitlines()[-1][-300:]
                continue
            runs[engine].append(res)
    if not runs["minfer"]:
        return f"minfer failed: {failed['minfer']}"
    first = runs["minfer"][0]
    nbytes = sum(first["bytes_by_type"].values())
    read_gbs = statistics.fmean(bandwidth)
    row: dict[str, Any] = {
        "file": str(path), "types": _type_mix(path),
        "share": first["bytes_by_type"].get(name, 0) / nbytes, "bytes_per_token": nbytes,
        "held_bytes_per_token": first["held_bytes_per_token"], "read_gb_per_s": read_gbs,
        "read_gb_per_s_samples": bandwidth,
    }
    for engine, samples in runs.items():
        if not samples:
            row[engine] = {"failed": failed[engine]}
            continue
        tg = f"tg{args.n}"
        rate = statistics.fmean(r for s in samples for r in s[tg])
        row[engine] = {"tok_per_s": rate, "samples": [s[tg] for s in samples],
                       "gb_per_s": nbytes * rate / 1e9,
                       "of_read_bandwidth": nbytes * rate / 1e9 / read_gbs}
        if engine == "minfer":
            held = first["held_bytes_per_token"] * rate / 1e9
            row[engine].update(held_gb_per_s=held, held_of_read_bandwidth=held / read_gbs)
    return row


def _cells(row: dict[str, Any]) -> list[str]:
    """A type's table cells after its name (✓: minfer at GOAL or more on its bytes)."""
    m, ll = row["minfer"], row["llama.cpp"]
    ok = " ✓" if m["of_read_bandwidth"] >= GOAL else ""
    if "failed" in ll:
        ll_cells = ["failed", "", ""]
    else:
        ll_cells = [f"{ll['tok_per_s']:.1f}", f"{m['tok_per_s'] / ll['tok_per_s']:.2f}x",
                    f"{ll['gb_per_s']:.1f} ({ll['of_read_bandwidth']:.0%})"]
    return [f"{row['share']:.0%}", f"{row['bytes_per_token'] / 2**20:.1f}",
            f"{row['held_bytes_per_token'] / 2**20:.1f}", f"{m['tok_per_s']:.1f}",
            *ll_cells[:2], f"{m['gb_per_s']:.1f} ({m['of_read_bandwidth']:.0%}){ok}",
            f"{m['held_gb_per_s']:.1f} ({m['held_of_read_bandwidth']:.0%})", ll_cells[2],
            f"{row['read_gb_per_s']:.1f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path,
                    default=Path.home() / ".cache/minfer/qwen2.5-coder-0.5b-instruct.gguf",
                    help="the GGUF every type is requantized from")
    ap.add_argument("--cache", type=Path, default=None,
                    help="where the requantized files are kept (made when missing; default "
                    "~/.cache/minfer/qtypes-<size>, e.g. qtypes-0.5b)")
    ap.add_argument("--llama-bin", type=Path, default=Path("/tmp/llbuild/bin"),
                    help="the folder of llama.cpp's llama-quantize and llama-imatrix")
    ap.add_argument("--types", default=",".join(TYPES),
                    help="comma-separated subset of: " + ", ".join(TYPES))
    ap.add_argument("--make-only", action="store_true",
                    help="make the missing files and stop")
    ap.add_argument("--discard", action="store_true",
                    help="delete each type's file and minfer's copies of it once measured "
                    "(the files of all types and minfer's copies take about 15 GB)")
    ap.add_argument("--ref-python", default="/tmp/refvenv/bin/python",
                    help="python with llama-cpp-python installed")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128, help="decode steps timed per rep (tg)")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    names = [n.strip().upper() for n in args.types.split(",") if n.strip()]
    unknown = [n for n in names if n not in TYPES]
    if unknown:
        ap.error(f"unknown types {unknown}; known: {', '.join(TYPES)}")
    started = time.monotonic()
    cache = args.cache or default_cache(args.source)
    if args.make_only:
        for name, why in make_files(names, args.source, cache, args.llama_bin)[1].items():
            print(f"{name}: skipped: {why}")
        return 0
    if not Path(args.ref_python).exists():
        ap.error(f"no reference interpreter at {args.ref_python}")
    from minfer.bench.bandwidth import read_bandwidth

    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in names:  # each file made just before it is measured (with --discard: one at a time)
        made, failed = make_files([name], args.source, cache, args.llama_bin)
        skipped.update(failed)
        if name not in made:
            continue
        path = made[name]
        print(f"{name} ...", file=sys.stderr, flush=True)
        row = measure(name, path, args, read_bandwidth)
        if isinstance(row, str):
            skipped[name] = row
        else:
            rows[name] = row
        if args.discard:
            for f in model_files(path):
                f.unlink(missing_ok=True)

    cpu = cpu_name()
    notes = [
        f"CPU: {cpu}; {args.threads} threads, minfer --backend {args.backend}; tg{args.n}, "
        f"{args.rounds} rounds x {args.reps} reps, alternating engines; "
        f"{(time.monotonic() - started) / 60:.0f} min",
        f"files: {args.source.name} ({_type_mix(args.source)}) requantized by llama-quantize "
        "--allow-requantize --pure (speed only: a requantized file is no guide to quality)",
        "bytes/token: the file's weight tensors a decode step reads (a tied embedding once, as "
        "the output matmul) plus one embedding row; share: of those bytes, the named type's "
        "(the rest: llama-quantize's fallbacks for rows not a multiple of 256)",
        "minfer holds: the same bytes as minfer's CPU backend keeps them (reencode.widen's Q6_K "
        f"/ Q7_K copies); read bw: minfer.bench.bandwidth.read_bandwidth({args.threads}), "
        f"before each type; goal (#65): minfer >= {GOAL:.0%} of read bw on its bytes",
    ]
    print("\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    print("| type | share | MiB/token | minfer holds | minfer tok/s | llama.cpp tok/s "
          "| minfer / llama.cpp | minfer GB/s (of read bw) on its bytes | on the bytes read "
          "| llama.cpp GB/s (of read bw) | read bw GB/s |")
    print("| --- |" + " ---: |" * 10)
    for name, row in rows.items():
        print(f"| {name} | {' | '.join(_cells(row))} |")
    for name, why in skipped.items():
        print(f"\n{name}: skipped: {why}")
    for name, row in rows.items():
        if "failed" in row["llama.cpp"]:
            print(f"\n{name}: llama.cpp failed: {row['llama.cpp']['failed']}")
    if args.json:
        args.json.write_text(json.dumps({
            "cpu": cpu, "threads": args.threads, "backend": args.backend, "n_gen": args.n,
            "rounds": args.rounds, "reps": args.reps, "source": str(args.source),
            "notes": notes, "goal": GOAL, "types": rows, "skipped": skipped,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
