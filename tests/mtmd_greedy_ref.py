"""llama.cpp's mtmd over a text GGUF and its mmproj, greedy (Qwen3-VL's M-RoPE positions; see also
`tests/mtmd_ref.py`, the embeddings and chunks of the Gemma 3 and Idefics3 references).

`SCRIPT` runs in an interpreter that has llama-cpp-python (`refpython.llama_python`): it lays
a prompt's `<image>` out with mtmd (`mtmd_tokenize`), evaluates the chunks
(`mtmd_helper_eval_chunks`, M-RoPE positions where the model has them) and decodes greedily,
printing the prompt's ids (-1 at each image token), the n_past mtmd left, the greedy tokens and
the logits each was drawn from.
"""

from __future__ import annotations

import numpy as np

from tests.refpython import run_json

SCRIPT = r'''
import ctypes, json, sys
import numpy as np
import llama_cpp
import llama_cpp.mtmd_cpp as m

model_path, mmproj, image, prompt = sys.argv[1:5]
n_gen = int(sys.argv[5])
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(model_path.encode(),
                                             llama_cpp.llama_model_default_params())
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 256, 256, 2, 2
ctx = llama_cpp.llama_init_from_model(model, cp)
mparams = m.mtmd_context_params_default()
mparams.use_gpu = False
mparams.n_threads = 2
mctx = m.mtmd_init_from_file(mmproj.encode(), model, mparams)
assert mctx
bitmap = m.mtmd_helper_bitmap_init_from_file(mctx, image.encode(), False)
text = m.mtmd_input_text()
buf = prompt.replace("<image>", m.mtmd_default_marker().decode()).encode()
text.text, text.text_len, text.add_special, text.parse_special = buf, len(buf), False, True
chunks = m.mtmd_input_chunks_init()
bitmaps = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
rc = m.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1)
assert rc == 0, rc
ids = []
for i in range(m.mtmd_input_chunks_size(chunks)):
    ch = m.mtmd_input_chunks_get(chunks, i)
    if m.mtmd_input_chunk_get_type(ch) == 0:
        n = ctypes.c_size_t()
        toks = m.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
        ids += [toks[j] for j in range(n.value)]
    else:
        ids += [-1] * m.mtmd_input_chunk_get_n_tokens(ch)
n_past = llama_cpp.llama_pos(0)
rc = m.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 256, True, ctypes.byref(n_past))
assert rc == 0, rc
start = n_past.value
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
rows, gen = [], []
for step in range(n_gen):
    lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    rows.append(lg.copy().tolist())
    gen.append(int(lg.argmax()))
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    batch.n_tokens = 1
    batch.token[0], batch.pos[0], batch.n_seq_id[0] = gen[-1], n_past.value, 1
    batch.seq_id[0][0], batch.logits[0] = 0, True
    assert llama_cpp.llama_decode(ctx, batch) == 0
    llama_cpp.llama_batch_free(batch)
    n_past.value += 1
print(json.dumps({"ids": ids, "n_past": start, "greedy": gen, "logits": rows}))
'''


def mtmd_greedy(python: str, model: str, mmproj: str, image: str, prompt: str,
                n: int) -> dict[str, np.ndarray]:
    """llama.cpp's ids, n_past, greedy tokens and their logits for the prompt and image."""
    out = run_json(python, SCRIPT, model, mmproj, image, prompt, str(n))
    assert isinstance(out, dict)
    return {"ids": np.array(out["ids"], np.int32), "n_past": np.array(out["n_past"], np.int32),
            "greedy": np.array(out["greedy"], np.int32),
            "decode_logits": np.array(out["logits"], np.float32)}
