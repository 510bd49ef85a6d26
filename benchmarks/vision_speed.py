"""Image encode speed: minfer's vision tower against llama.cpp's mtmd on the same synthetic files.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/vision_speed.py \
        [--towers siglip,qwen3vl] [--n 2] [--rounds 3] [--threads 2] [--type f16|q8_0|f32] \
        [--siglip-size 448] [--encoder-f32] [--profile] [--tiny] [--json out.json]

For each tower (`minfer.tools.synth.mmproj`: SigLIP-So400m as Gemma 3's projector, at 448 by
default, and Qwen3-VL-2B's tower), written once under --dir with a matching one-layer text
GGUF, a generated 448 x 448 image is preprocessed once by each engine and its tower run N times
per round: minfer's `VisionEncoder.encode_pixels` (the tower itself: no image decode, no
embedding LRU) in this process, mtmd's `mtmd_encode_chunk` (what mtmd-helper times as "image
slice encoded") in a long-lived subprocess of the reference interpreter ($MINFER_REF_PYTHON or
/tmp/refvenv/bin/python), both on --threads threads, rounds interleaved, one warm encode each
first. Reported: each engine's median ms per image, the ratio (llama.cpp / minfer: above 1 is
minfer faster), and the largest difference of the two engines' embeddings over the largest
|value| of mtmd's (the same work: same pixels, same weights). mtmd's encoder attention is its
default (flash attention on CPU: K and V in f16) unless --flash-attn off.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SERVER = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import mtmd_cpp as mt

model_path, mmproj, image, threads, flash = sys.argv[1:6]
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(model_path.encode(),
                                             llama_cpp.llama_model_default_params())
assert model, "cannot load the text model"
p = mt.mtmd_context_params_default()
p.use_gpu, p.n_threads, p.print_timings = False, int(threads), False
p.flash_attn_type = int(flash)
mctx = mt.mtmd_init_from_file(mmproj.encode(), model, p)
assert mctx, "cannot load the mmproj"
bitmap = mt.mtmd_helper_bitmap_init_from_file(mctx, image.encode(), False)
chunks = mt.mtmd_input_chunks_init()
text = mt.mtmd_default_marker()
inp = mt.mtmd_input_text(text, len(text), False, True)
assert mt.mtmd_tokenize(mctx, chunks, ctypes.byref(inp),
                        (mt.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
chunk = None
for i in range(mt.mtmd_input_chunks_size(chunks)):
    c = mt.mtmd_input_chunks_get(chunks, i)
    if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
        chunk = c
assert chunk is not None
n_tok = mt.mtmd_image_tokens_get_n_tokens(mt.mtmd_input_chunk_get_tokens_image(chunk))
width = llama_cpp.llama_model_n_embd_inp(model)
assert mt.mtmd_encode_chunk(mctx, chunk) == 0  # warm
print(json.dumps({"ready": True, "n_tokens": n_tok, "width": width}), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "time":
        ms = []
        for _ in range(int(cmd[1])):
            t0 = time.perf_counter()
            assert mt.mtmd_encode_chunk(mctx, chunk) == 0
            ms.append((time.perf_counter() - t0) * 1e3)
        print(json.dumps({"ms": ms}), flush=True)
    elif cmd[0] == "embd":
        ptr = mt.mtmd_get_output_embd(mctx)
        np.save(cmd[1], np.ctypeslib.as_array(ptr, shape=(n_tok * width,)).reshape(n_tok, width))
        print(json.dumps({"saved": cmd[1]}), flush=True)
"""

TINY = {"siglip": dict(n_layer=2, n_embd=64, n_head=4, n_ff=128, n_embd_text=256),
        "qwen3vl": dict(n_layer=3, n_embd=64, n_head=4, n_ff=128, deepstack=(0, 2),
                        n_embd_text=256)}


def _image(path: Path, side: int = 448) -> Path:
    from PIL import Image

    if not path.exists():
        rng = np.random.default_rng(0)
        y, x = np.mgrid[0:side, 0:side]
        rgb = np.stack([x * 255 // side, y * 255 // side, (x + y) * 127 // side], -1)
        rgb = rgb + rng.integers(0, 60, (side, side, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB").save(buf, "PNG")
        path.write_bytes(buf.getvalue())
    return path


def _files(tower: str, args: argparse.Namespace) -> tuple[Path, Path]:
    """(mmproj, text model) for a tower, written under --dir unless there already."""
    from gguf import GGMLQuantizationType as QType

    from minfer.tools.synth.mmproj import (
        write_qwen3vl_mmproj,
        write_siglip_mmproj,
        write_text_for_mmproj,
    )

    qtype = {"f16": QType.F16, "q8_0": QType.Q8_0, "f32": QType.F32}[args.type]
    size = f"-{args.siglip_size}" if tower == "siglip" else ""
    stem = f"{tower}{size}-{args.type}{'-tiny' if args.tiny else ''}"
    mmproj, text = args.dir / f"{stem}.mmproj.gguf", args.dir / f"{stem}.text.gguf"
    if not mmproj.exists():
        kw: dict[str, Any] = dict(TINY[tower]) if args.tiny else {}
        tmp = mmproj.with_suffix(".part")
        if tower == "siglip":
            write_siglip_mmproj(tmp, image_size=args.siglip_size, weight_type=qtype, **kw)
        else:
            write_qwen3vl_mmproj(tmp, weight_type=qtype, **kw)
        tmp.rename(mmproj)
    if not text.exists():
        write_text_for_mmproj(text, mmproj)
    return mmproj, text


def _bench(tower: str, args: argparse.Namespace, python: str | None) -> dict[str, Any]:
    from minfer.engine.forward import set_threads
    from minfer.engine.vision.encoder import VisionEncoder
    from minfer.engine.vision.image import preprocess

    mmproj, text = _files(tower, args)
    image = _image(args.dir / "image448.png")
    set_threads(args.threads)
    enc = VisionEncoder(mmproj)
    chunk = preprocess(image.read_bytes(), enc.params).chunks[0]
    t0 = time.perf_counter()
    ours = enc.encode_pixels(chunk)  # warm (binds the tower, compiles what is not cached)
    first = (time.perf_counter() - t0) * 1e3
    if enc.profile is not None:  # the timed runs only
        enc.profile.clear()
    n_warm = enc.n_encoded
    result: dict[str, Any] = {"tower": tower, "mmproj": str(mmproj), "type": args.type,
                              "pixels": list(chunk.shape), "rows": list(ours.shape),
                              "minfer_first_ms": round(first, 1), "threads": args.threads}
    server = None
    if python is not None:
        server = subprocess.Popen(
            [python, "-c", SERVER, str(text), str(mmproj), str(image), str(args.threads),
             "0" if args.flash_attn == "off" else "-1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            stderr=(args.dir / f"{tower}-mtmd.log").open("w"))
        assert server.stdin is not None and server.stdout is not None
        hello = json.loads(server.stdout.readline())
        result["mtmd_rows"] = [hello["n_tokens"], hello["width"]]
    ours_ms: list[float] = []
    theirs_ms: list[float] = []
    try:
        for _ in range(args.rounds):
            for _ in range(args.n):
                t0 = time.perf_counter()
                enc.encode_pixels(chunk)
                ours_ms.append((time.perf_counter() - t0) * 1e3)
            if server is not None:
                assert server.stdin is not None and server.stdout is not None
                server.stdin.write(f"time {args.n}\n")
                server.stdin.flush()
                theirs_ms += json.loads(server.stdout.readline())["ms"]
        if server is not None:
            assert server.stdin is not None and server.stdout is not None
            path = args.dir / f"{tower}-mtmd-embd.npy"
            server.stdin.write(f"embd {path}\n")
            server.stdin.flush()
            server.stdout.readline()
            ref = np.load(path)
            result["max_rel_diff"] = float(np.abs(ours - ref).max() / np.abs(ref).max()) \
                if ref.shape == ours.shape else f"shapes {ours.shape} vs {ref.shape}"
    finally:
        if server is not None:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(timeout=60)
    if enc.profile is not None:  # MINFER_PROFILE: ms per image by op:role, largest first
        n_runs = enc.n_encoded - n_warm
        result["minfer_profile_ms"] = {k: round(v * 1e3 / n_runs, 1) for k, v in sorted(
            enc.profile.items(), key=lambda kv: -kv[1])}
    result["minfer_ms"] = round(statistics.median(ours_ms), 1)
    result["minfer_all_ms"] = [round(t, 1) for t in ours_ms]
    if theirs_ms:
        result["mtmd_ms"] = round(statistics.median(theirs_ms), 1)
        result["mtmd_all_ms"] = [round(t, 1) for t in theirs_ms]
        result["speedup"] = round(result["mtmd_ms"] / result["minfer_ms"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--towers", default="siglip,qwen3vl")
    ap.add_argument("--n", type=int, default=2, help="images per engine per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--type", choices=("f16", "q8_0", "f32"), default="f16")
    ap.add_argument("--siglip-size", type=int, default=448, choices=(448, 896))
    ap.add_argument("--flash-attn", choices=("auto", "off"), default="auto")
    ap.add_argument("--encoder-f32", action="store_true",
                    help="MINFER_ENCODER_F32: minfer's exact f32 GEMM, not AMX bf16 / int8")
    ap.add_argument("--profile", action="store_true",
                    help="MINFER_PROFILE: minfer's ms per image by op:role (slower per node)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (a smoke run)")
    ap.add_argument("--no-llama", action="store_true", help="minfer only")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "minfer" / "synth-vision")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.encoder_f32:
        os.environ["MINFER_ENCODER_F32"] = "1"
    if args.profile:
        os.environ["MINFER_PROFILE"] = "1"
    python = None
    if not args.no_llama:
        python = os.environ.get("MINFER_REF_PYTHON", "/tmp/refvenv/bin/python")
        if not Path(python).exists():
            print(f"no reference interpreter at {python}: minfer only", file=sys.stderr)
            python = None
    results = []
    for tower in args.towers.split(","):
        r = _bench(tower, args, python)
        results.append(r)
        line = (f"{tower:8s} {args.type} pixels {r['pixels']} rows {r['rows']}: "
                f"minfer {r['minfer_ms']:.0f} ms/image")
        if "mtmd_ms" in r:
            line += (f", mtmd {r['mtmd_ms']:.0f} ms/image, mtmd/minfer {r['speedup']:.2f}x, "
                     f"max rel diff {r['max_rel_diff']}")
        print(line, flush=True)
        for key, ms in list(r.get("minfer_profile_ms", {}).items())[:12]:
            print(f"    {key:40s} {ms:9.1f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
