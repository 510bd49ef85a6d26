"""Regenerate tests/fixtures/kv_quant_llamacpp.npz: llama.cpp's quantized KV caches on the
development model, for tests/test_kv_cache_types.py.

Run with the interpreter that has llama-cpp-python (not minfer's venv):

    /tmp/refvenv/bin/python benchmarks/make_kv_quant_fixture.py \
        ~/.cache/minfer/qwen2.5-coder-0.5b-instruct.gguf tests/fixtures/kv_quant_llamacpp.npz

Sequences: the public prompts of tests/fixtures/greedy.json with their greedy continuations,
then tests/fixtures/kv_long_prompt.txt (tokenized by llama.cpp, no BOS). One context per cache
type (f16, q8_0, q4_0 for both K and V; flash attention on, which llama.cpp needs for a quantized
V; n_ctx 1024, one 1024-token batch, 2 threads), logits at every position. Stored per sequence
i: `ids{i}` the token ids, `top{i}` the f16 cache's top-10 ids at each position, and
`f16{i}`, `q8_0{i}`, `q4_0{i}` each cache's logits at those ids. Also llama.cpp's layer-0 cache
rows (raw ggml blocks, from the saved state) after the first `N_ROWS` tokens of the long prompt:
`k_q8_0`, `v_q8_0`, `k_q4_0`, `v_q4_0`; `meta` is a JSON string saying where it all came from.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
GGML = {"f16": 1, "q4_0": 2, "q8_0": 8}
N_ROWS = 16


def _llama(model: str, kv: str) -> object:
    from llama_cpp import Llama

    return Llama(model_path=model, n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2,
                 n_threads_batch=2, type_k=GGML[kv], type_v=GGML[kv], flash_attn=True,
                 logits_all=True, verbose=False)


def _layer0_rows(llm: object, kv: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's K and V rows of cells [0, n) from llama.cpp's state blob: after the cell
    metadata come v_trans (0 with flash attention) and n_layer, then per layer the type, the
    row size and the rows (all K layers, then all V layers)."""
    blob = bytes(llm.save_state().llama_state)  # type: ignore[attr-defined]
    n_layer = llm.n_layer() if hasattr(llm, "n_layer") else \
        int(llm.metadata["qwen2.block_count"])  # type: ignore[attr-defined]
    for row in range(18, 1 << 16, 2):
        at = blob.find(struct.pack("<IIiQ", 0, n_layer, GGML[kv], row))
        if at >= 0:
            break
    else:
        raise SystemExit("llama.cpp's state layout was not recognised")
    k_at = at + 8 + 12
    v_at = at + 8 + n_layer * (12 + n * row) + 12
    assert struct.unpack_from("<iQ", blob, v_at - 12) == (GGML[kv], row)
    return (np.frombuffer(blob, np.uint8, n * row, k_at).reshape(n, row),
            np.frombuffer(blob, np.uint8, n * row, v_at).reshape(n, row))


def main(model: str, out: str) -> None:
    import llama_cpp

    cases = json.loads((FIXTURES / "greedy.json").read_text())["cases"]
    seqs = [c["prompt_ids"] + c["greedy_ids"][:-1] for c in cases]
    llm = _llama(model, "f16")
    long_text = (FIXTURES / "kv_long_prompt.txt").read_text().encode()
    seqs.append(llm.tokenize(long_text, add_bos=False))  # type: ignore[attr-defined]
    arrays: dict[str, np.ndarray] = {f"ids{i}": np.array(s, np.int32) for i, s in enumerate(seqs)}
    for kv in ("f16", "q8_0", "q4_0"):
        llm = llm if kv == "f16" else _llama(model, kv)
        for i, s in enumerate(seqs):
            llm.reset()  # type: ignore[attr-defined]
            llm.eval(s)  # type: ignore[attr-defined]
            lg = np.array(llm.scores[: len(s)], np.float32)  # type: ignore[attr-defined]
            if kv == "f16":
                arrays[f"top{i}"] = np.argsort(-lg, axis=1)[:, :10].astype(np.int32)
            arrays[f"{kv}{i}"] = np.take_along_axis(lg, arrays[f"top{i}"], 1)
        if kv != "f16":
            llm.reset()  # type: ignore[attr-defined]
            llm.eval(seqs[-1][:N_ROWS])  # type: ignore[attr-defined]
            arrays[f"k_{kv}"], arrays[f"v_{kv}"] = _layer0_rows(llm, kv, N_ROWS)
    meta = {"source": f"llama-cpp-python {llama_cpp.__version__}, benchmarks/"
                      "make_kv_quant_fixture.py: n_ctx 1024, 2 threads, flash attention on",
            "model": Path(model).name,
            "model_sha256": hashlib.sha256(Path(model).read_bytes()).hexdigest(),
            "n_seqs": len(seqs), "n_rows": N_ROWS}
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
    print(f"wrote {out}: {len(seqs)} sequences, {sum(map(len, seqs))} positions")


if __name__ == "__main__":
    main(*sys.argv[1:3])
