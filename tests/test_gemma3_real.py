"""Gemma-3-270M (Q4_K_M, the catalogue's `gemma-3-270m`) against llama.cpp's reference.

tests/fixtures/gemma3_greedy.json comes from benchmarks/make_gemma_reference.py (llama.cpp via
llama-cpp-python, flash-attn off, f16 KV). The prompts are fed as llama.cpp's token ids, so
these tests need no SentencePiece tokenizer. The rule is the development model's (see
test_reference_llamacpp.py): the same top-1 at the last prompt position, llama.cpp's top-10
logits close to minfer's, and a greedy continuation equal to llama.cpp's or diverging only
where llama.cpp's own top-2 margin is below 0.5.

"Close" is 0.8 here, not 0.5: this model's logits move that much under changes of rounding
alone. Measured on these prompts: llama.cpp's AVX2 build differs from its AVX-512 build by up
to 0.55 in the top-10 logits, and minfer's f32 KV cache from its f16 one by up to 0.36; minfer
(f16 KV) against llama.cpp (AVX-512) is 0.27-0.55, and both are 0.4-1.6 (max over the vocabulary)
from a float64 forward pass of the same weights, as far from it as from each other. Summing the
Q5_0 / Q8_0 rows' blocks in another order (rows interleaved 16 at a time, `simd_rows`; as
accurate against float64 within 1.1-1.6x) moved the top-10 gaps from 0.32-0.55 to 0.18-0.71,
and the whole vocabulary's logits by up to 1.7.

Op by op against llama.cpp's intermediate tensors (its eval callback; each minfer kernel fed
llama.cpp's inputs) every op agrees to f32 rounding (1e-7 relative) but two: the GELU table
(234 entries an f16 ulp off; now ggml's exactly) and the attention's value mix, which ggml runs
on probabilities rounded to f16 (`mul_mat(V, softmax)` over an f16 V converts them) where minfer
keeps f32 (1.6e-4 per attention output; rounding them as ggml does was tried and moved the gap
around without shrinking it; the rest is the quantized dots' float order:
tests/test_gemma3_drift.py). Neither moves the gap: over these six prompts and
twelve chat / prose ones, against llama.cpp's AVX2 build (AMD EPYC Zen 3), the top-10 gap was
0.16-0.80 before and after the GELU fix, 0.21-0.86 with f16 probabilities too; one f32 ulp up
or down on the embedding scale moves minfer's own top-10 logits by 0.18-1.34 on the same
prompts (f16 K/V and Q8 activations turn ulp-level differences into whole rounding steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

REF = json.loads((Path(__file__).parent / "fixtures" / "gemma3_greedy.json").read_text())
CASES = REF["cases"]
NEAR_TIE = 0.5
LOGIT_TOL = 0.8


@pytest.fixture(scope="module")
def engine() -> Engine:
    from minfer.store.download import pull

    f = GGUFFile.open(pull("gemma-3-270m", progress=False))
    hp = HParams.from_gguf(f)
    assert (hp.arch, hp.sliding_window, hp.swa_layers.count(False)) == ("gemma3", 512, 3)
    return Engine(f, hp, n_ctx=256)


@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:20] for c in CASES])
def test_last_position_logits_match(engine: Engine, case: dict[str, Any]) -> None:
    logits = engine.forward(case["prompt_ids"], 0)[0]
    ref = case["top10_last_prompt_pos"]
    assert int(np.argmax(logits)) == ref[0][0]
    diffs = [abs(float(logits[tok]) - val) for tok, val in ref]
    assert max(diffs) < LOGIT_TOL, diffs


@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:20] for c in CASES])
def test_greedy_continuation_matches(engine: Engine, case: dict[str, Any]) -> None:
    ids = list(case["prompt_ids"])
    logits = engine.forward(ids, 0)[0]
    for step, want in enumerate(case["greedy_ids"]):
        got = int(np.argmax(logits))
        if got != want:
            top = case["steps"][step]["top5"]
            margin = top[0][1] - top[1][1]
            assert margin < NEAR_TIE, f"diverged at confident step {step} (margin {margin:.3f})"
            return  # past a near-tie the two continuations are different texts
        logits = engine.forward([got], len(ids))[0]
        ids.append(got)


def test_end_of_turn_is_end_of_generation(engine: Engine) -> None:
    """`<end_of_turn>` (106) stops generation, as in llama.cpp, next to `<eos>` (1)."""
    from minfer.tokenizer.vocab import _end_of_generation

    meta = engine.weights.file.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = np.array(meta["tokenizer.ggml.token_type"], dtype=np.int32)
    assert tokens[106] == "<end_of_turn>"
    ids = dict(zip(tokens, range(len(tokens)), strict=True))
    assert {1, 106} <= _end_of_generation(meta, tokens, ids, types)


def test_text_prompts_tokenize_to_llama_cpps_ids(engine: Engine) -> None:
    """With the SentencePiece tokenizer the reference prompts go in as text: BOS as the
    vocabulary asks, then the same ids llama.cpp gave."""
    from minfer.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(engine.weights.file)
    for case in CASES:
        assert tok.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]


def test_a_chat_turn_through_minfer_serve() -> None:
    """One chat turn over HTTP: Gemma's template, the reply ended by <end_of_turn> (a stop), the
    streamed text equal to the plain one; then the same turn through `minfer chat`."""
    import subprocess
    import sys

    from minfer.store.download import pull
    from tests.test_server_process import serving

    path = pull("gemma-3-270m", progress=False)
    msgs = [{"role": "user", "content": "Say hello in French, in one word."}]
    with serving(path, "--slots", "2", "--n-ctx", "512", timeout=600) as srv:
        c = srv.client()
        r = c.chat.completions.create(model="gemma", messages=msgs, max_tokens=32,  # type: ignore[arg-type]
                                      temperature=0.0)
        text = r.choices[0].message.content or ""
        assert text.strip() and "<end_of_turn>" not in text and "<start_of_turn>" not in text
        assert r.choices[0].finish_reason in ("stop", "length")
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="gemma", messages=msgs, max_tokens=32, temperature=0.0, stream=True)  # type: ignore[arg-type]
            if ch.choices)
        assert streamed == text
    chat = subprocess.run([sys.executable, "-m", "minfer.cli.main", "chat", str(path), "-n", "32",
                           "--temp", "0"], input=msgs[0]["content"] + "\n/exit\n",
                          capture_output=True, text=True, timeout=600, check=False)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert text.strip() in chat.stdout
