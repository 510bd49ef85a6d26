"""llama.cpp's mtmd on an image prompt, run in the reference interpreter (llama-cpp-python's
`llama_cpp.mtmd_cpp` bindings), for the fixtures of tests/test_vision_mtmd.py.

`run(python, model, mmproj, image, text)` runs `SCRIPT` in a subprocess of `python` (never
imported here: the reference build stays out of minfer's interpreter). The script loads the
text GGUF and the mmproj, tokenizes `text` (the rendered chat prompt holding `<__media__>`) with
the image file through `mtmd_tokenize` (add_special, parse_special: as llama-server), encodes
each image chunk (`mtmd_encode_chunk`, `mtmd_get_output_embd`), evaluates the chunks
(`mtmd_helper_eval_chunks`, n_batch 512, logits of the last position), and decodes greedily
`n_greedy` tokens (llama_decode one token at a time, f32 KV, one thread, no flash attention
in the text model; the encoder's as `flash_attn` says).

It returns {"chunks": [{"type": "text", "tokens": [...]} | {"type": "image", "n_tokens",
"nx", "ny", "n_pos", "non_causal"}], "n_tokens", "n_pos", "greedy": [...], "margins": [the
top-1 minus top-2 logit before each greedy token]} and writes `embd` (the image chunks' rows,
concatenated in prompt order) and `logits` ([n_greedy + 1, n_vocab]: after the prompt, then
after each greedy token) to the .npz `out`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

SCRIPT = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
from llama_cpp import mtmd_cpp as mt

model_path, mmproj, image, text, n_greedy, out = sys.argv[1:7]
n_greedy = int(n_greedy)
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params()
model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
assert model, "cannot load the model"
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
cp.n_threads = cp.n_threads_batch = 1
cp.type_k = cp.type_v = 0  # f32 KV
cp.flash_attn_type = 0
ctx = llama_cpp.llama_init_from_model(model, cp)
assert ctx, "cannot make a context"
vocab = llama_cpp.llama_model_get_vocab(model)
n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

mparams = mt.mtmd_context_params_default()
mparams.use_gpu = False
mparams.n_threads = 1
mparams.print_timings = False
mparams.warmup = False
mparams.flash_attn_type = int(sys.argv[7])  # -1 auto (llama-server's default), 0 off
mctx = mt.mtmd_init_from_file(mmproj.encode(), model, mparams)
assert mctx, "cannot load the mmproj"

bitmap = mt.mtmd_helper_bitmap_init_from_file(mctx, image.encode(), False)
assert bitmap, "cannot read the image"
chunks = mt.mtmd_input_chunks_init()
raw = text.encode()
inp = mt.mtmd_input_text(raw, len(raw), True, True)
bitmaps = (mt.mtmd_bitmap_p_ctypes * 1)(bitmap)
rc = mt.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), bitmaps, 1)
assert rc == 0, f"mtmd_tokenize: {rc}"

layout, embd = [], []
for i in range(mt.mtmd_input_chunks_size(chunks)):
    chunk = mt.mtmd_input_chunks_get(chunks, i)
    kind = mt.mtmd_input_chunk_get_type(chunk)
    if kind == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
        n = ctypes.c_size_t()
        toks = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        layout.append({"type": "text", "tokens": [int(toks[j]) for j in range(n.value)]})
        continue
    assert kind == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE
    img = mt.mtmd_input_chunk_get_tokens_image(chunk)
    nt = mt.mtmd_image_tokens_get_n_tokens(img)
    layout.append({"type": "image", "n_tokens": nt,
                   "nx": mt.mtmd_image_tokens_get_nx(img),
                   "ny": mt.mtmd_image_tokens_get_ny(img),
                   "n_pos": mt.mtmd_input_chunk_get_n_pos(chunk),
                   "non_causal": bool(mt.mtmd_decode_use_non_causal(mctx, chunk))})
    assert mt.mtmd_encode_chunk(mctx, chunk) == 0
    width = llama_cpp.llama_model_n_embd_inp(model) if hasattr(
        llama_cpp, "llama_model_n_embd_inp") else llama_cpp.llama_model_n_embd(model)
    ptr = mt.mtmd_get_output_embd(mctx)
    embd.append(np.ctypeslib.as_array(ptr, shape=(nt * width,)).reshape(nt, width).copy())

n_past = llama_cpp.llama_pos(0)
rc = mt.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past))
assert rc == 0, f"mtmd_helper_eval_chunks: {rc}"

def last_logits():
    p = llama_cpp.llama_get_logits_ith(ctx, -1)
    return np.ctypeslib.as_array(p, shape=(n_vocab,)).astype(np.float32).copy()

logits, greedy, margins = [last_logits()], [], []
pos = n_past.value
for _ in range(n_greedy):
    top = np.sort(logits[-1])[-2:]
    margins.append(float(top[1] - top[0]))
    tok = int(np.argmax(logits[-1]))
    greedy.append(tok)
    arr = (llama_cpp.llama_token * 1)(tok)
    batch = llama_cpp.llama_batch_get_one(arr, 1)
    assert llama_cpp.llama_decode(ctx, batch) == 0
    pos += 1
    logits.append(last_logits())

np.savez(out, embd=np.concatenate(embd).astype(np.float32) if embd else np.zeros((0, 0)),
         logits=np.stack(logits))
print(json.dumps({"chunks": layout, "n_tokens": mt.mtmd_helper_get_n_tokens(chunks),
                  "n_pos": mt.mtmd_helper_get_n_pos(chunks), "greedy": greedy,
                  "margins": margins}))
"""


def run(python: str, model: Path, mmproj: Path, image: Path, text: str, out: Path, *,
        n_greedy: int = 6, flash_attn: bool = False) -> dict[str, Any]:
    """SCRIPT's JSON (see the module docstring); the arrays are in `out`. flash_attn: the
    encoder's attention as mtmd's default picks on CPU (K and V in f16); off: in f32."""
    proc = subprocess.run([python, "-c", SCRIPT, str(model), str(mmproj), str(image), text,
                           str(n_greedy), str(out), "-1" if flash_attn else "0"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
