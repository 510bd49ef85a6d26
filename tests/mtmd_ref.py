"""llama.cpp's mtmd on an image prompt, run in the reference interpreter (llama-cpp-python's
`llama_cpp.mtmd_cpp` bindings): the one runner behind the vision fixtures and live checks
(tests/test_vision_mtmd.py, test_vision_lfm2vl.py, test_vision_qwen3vl.py).

`SCRIPT` runs in a subprocess of a reference `python` (never imported here: the reference build
stays out of minfer's interpreter). It loads the text GGUF and the mmproj, tokenizes the text
(the rendered chat prompt holding `<__media__>`) with the image file through `mtmd_tokenize`
(parse_special; add_special as asked), encodes each image chunk (`mtmd_encode_chunk`,
`mtmd_get_output_embd`), evaluates the chunks (`mtmd_helper_eval_chunks`, n_batch = n_ctx,
logits of the last position; M-RoPE positions where the model has them) and decodes greedily
`n_greedy` tokens, one at a time at the positions mtmd's n_past continues from. It prints
{"chunks": [{"type": "text", "tokens": [...]} | {"type": "image", "n_tokens", "nx", "ny",
"n_pos", "non_causal"}], "n_tokens", "n_pos", "n_past", "greedy": [...], "margins": [the top-1
minus top-2 logit before each greedy token]} and writes `embd` (the image chunks' rows,
concatenated in prompt order) and `logits` ([n_greedy + 1, n_vocab]: after the prompt, then
after each greedy token) to an .npz.

Two settings, as the fixtures were made:
- `run` (Gemma 3, Idefics3, LFM2-VL): exact (one thread, f32 KV, no flash attention in the text
  model; the encoder's flash attention as asked), add_special; its JSON and the .npz `out`.
- `mtmd_greedy` (Qwen3-VL): llama.cpp's defaults (two threads, f16 KV, flash attention auto,
  n_ctx 256), no add_special, `<image>` in the prompt for the marker; the arrays ids (-1 at
  each image token), n_past, greedy and decode_logits (the logits each greedy token was drawn
  from).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SCRIPT = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
from llama_cpp import mtmd_cpp as mt

a = json.loads(sys.argv[1])
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params()
model = llama_cpp.llama_model_load_from_file(a["model"].encode(), mp)
assert model, "cannot load the model"
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = cp.n_batch = cp.n_ubatch = a["n_ctx"]
cp.n_threads = cp.n_threads_batch = a["n_threads"]
if a["exact"]:
    cp.type_k = cp.type_v = 0  # f32 KV
    cp.flash_attn_type = 0
ctx = llama_cpp.llama_init_from_model(model, cp)
assert ctx, "cannot make a context"
vocab = llama_cpp.llama_model_get_vocab(model)
n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

mparams = mt.mtmd_context_params_default()
mparams.use_gpu = False
mparams.n_threads = a["n_threads"]
if a["exact"]:
    mparams.print_timings = False
    mparams.warmup = False
    mparams.flash_attn_type = a["encoder_flash"]  # -1 auto (llama-server's default), 0 off
mctx = mt.mtmd_init_from_file(a["mmproj"].encode(), model, mparams)
assert mctx, "cannot load the mmproj"

bitmap = mt.mtmd_helper_bitmap_init_from_file(mctx, a["image"].encode(), False)
assert bitmap, "cannot read the image"
chunks = mt.mtmd_input_chunks_init()
raw = a["text"].encode()
inp = mt.mtmd_input_text(raw, len(raw), a["add_special"], True)
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
rc = mt.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, a["n_ctx"], True, ctypes.byref(n_past))
assert rc == 0, f"mtmd_helper_eval_chunks: {rc}"
start = n_past.value

def last_logits():
    p = llama_cpp.llama_get_logits_ith(ctx, -1)
    return np.ctypeslib.as_array(p, shape=(n_vocab,)).astype(np.float32).copy()

logits, greedy, margins = [last_logits()], [], []
for _ in range(a["n_greedy"]):
    top = np.sort(logits[-1])[-2:]
    margins.append(float(top[1] - top[0]))
    greedy.append(int(np.argmax(logits[-1])))
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    batch.n_tokens = 1
    batch.token[0], batch.pos[0], batch.n_seq_id[0] = greedy[-1], n_past.value, 1
    batch.seq_id[0][0], batch.logits[0] = 0, True
    assert llama_cpp.llama_decode(ctx, batch) == 0
    llama_cpp.llama_batch_free(batch)
    n_past.value += 1
    logits.append(last_logits())

np.savez(a["out"], embd=np.concatenate(embd).astype(np.float32) if embd else np.zeros((0, 0)),
         logits=np.stack(logits))
print(json.dumps({"chunks": layout, "n_tokens": mt.mtmd_helper_get_n_tokens(chunks),
                  "n_pos": mt.mtmd_helper_get_n_pos(chunks), "n_past": start,
                  "greedy": greedy, "margins": margins}))
"""


def _script(python: str, **args: Any) -> dict[str, Any]:
    """SCRIPT's JSON for these arguments (see the module docstring)."""
    proc = subprocess.run([python, "-c", SCRIPT, json.dumps(args)], capture_output=True,
                          text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run(python: str, model: Path, mmproj: Path, image: Path, text: str, out: Path, *,
        n_greedy: int = 6, flash_attn: bool = False, n_ctx: int = 512) -> dict[str, Any]:
    """The exact run's JSON (chunks, n_tokens, n_pos, greedy, margins); its arrays (embd,
    logits) in `out`. flash_attn: the encoder's attention as mtmd's default picks on CPU (K
    and V in f16); off: in f32. n_ctx: the text context (and batch)."""
    result = _script(python, model=str(model), mmproj=str(mmproj), image=str(image), text=text,
                     out=str(out), n_greedy=n_greedy, n_ctx=n_ctx, n_threads=1, exact=True,
                     add_special=True, encoder_flash=-1 if flash_attn else 0)
    result.pop("n_past")
    return result


def mtmd_greedy(python: str, model: str, mmproj: str, image: str, prompt: str,
                n: int) -> dict[str, np.ndarray]:
    """llama.cpp's ids (-1 at each image token), n_past, greedy tokens and their logits for
    the prompt (`<image>` where the image goes) and image, at llama.cpp's default settings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.npz"
        result = _script(python, model=model, mmproj=mmproj, image=image,
                         text=prompt.replace("<image>", "<__media__>"), out=str(out),
                         n_greedy=n, n_ctx=256, n_threads=2, exact=False, add_special=False,
                         encoder_flash=-1)
        logits = np.load(out)["logits"]
    ids = [t for c in result["chunks"]
           for t in (c["tokens"] if c["type"] == "text" else [-1] * c["n_tokens"])]
    return {"ids": np.array(ids, np.int32), "n_past": np.array(result["n_past"], np.int32),
            "greedy": np.array(result["greedy"], np.int32),
            "decode_logits": logits[:n].astype(np.float32)}
