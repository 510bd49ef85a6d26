"""`minfer convert` on tiny random SmolLM3 and Phi-3 checkpoints (transformers 5.x): the same
bytes as llama.cpp 0.3.36's convert_hf_to_gguf.py, and minfer's logits on the file against
transformers' own forward. `smollm3`: byte-level BPE (Llama 3's split), Q/K rows permuted as
Llama's; `phi3`: Phi-4-mini's layout (a GPT2Tokenizer BPE, fused qkv_proj / gate_up_proj,
partial rotary, tied); `phi3_longrope`: Phi-3-mini-128k's (SentencePiece, LongRoPE factors and
magnitude, untied)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.convert import convert_hf
from minfer.gguf.reader import GGUFFile
from tests.hf_tiny import hf_logits, write_checkpoint
from tests.llama_convert import reference_convert

FAMILIES = ("smollm3", "phi3", "phi3_longrope")
OUTTYPE = {"smollm3": "f16", "phi3": "q8_0", "phi3_longrope": "f32"}
PRE = {"smollm3": "llama-bpe", "phi3": "qwen2"}  # BPE pre-tokenizer names
IDS = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: write_checkpoint(root / f, f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_minfer_logits_match_transformers(family: str, ckpts: dict[str, Path],
                                          tmp_path: Path) -> None:
    import minfer

    path = convert_hf(ckpts[family], tmp_path / f"{family}.gguf", outtype="f32", progress=False)
    ref = hf_logits(ckpts[family], IDS)
    model = minfer.load(path, n_ctx=64, backend="cpu", kv_type="f32")
    got = model.engine(len(IDS)).forward(IDS, 0)[0]
    # f32 weights and KV: only summation order differs
    assert np.abs(got - ref).max() < 1e-5 * max(1.0, float(np.abs(ref).max()))


@pytest.mark.slow
def test_same_bytes_as_llama_cpp_converter(ckpts: dict[str, Path],
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("ref")
    reference_convert([(ckpts[f], root / f"{f}.gguf", OUTTYPE[f], PRE.get(f))
                       for f in FAMILIES])
    for family in FAMILIES:
        ref = root / f"{family}.gguf"
        ours = convert_hf(ckpts[family], root / f"{family}-ours.gguf", outtype=OUTTYPE[family],
                          progress=False)
        if ours.read_bytes() == ref.read_bytes():
            continue
        with GGUFFile.open(ours) as a, GGUFFile.open(ref) as b:  # say where, before failing
            keys = set(a.metadata.keys() ^ b.metadata.keys())
            keys |= {k for k in a.metadata.keys() & b.metadata.keys()
                     if str(a.metadata[k]) != str(b.metadata[k])}
            order = list(a.metadata) != list(b.metadata) or list(a.tensors) != list(b.tensors)
            tensors = [n for n in a.tensors if n not in b.tensors
                       or a.tensors[n].type_name != b.tensors[n].type_name
                       or not np.array_equal(a.raw(n), b.raw(n))]
        pytest.fail(f"{family} differs from llama.cpp: metadata {sorted(keys)}, tensors "
                    f"{tensors}, order differs: {order}")


def test_longrope_written_as_llama_cpp_writes_it(ckpts: dict[str, Path],
                                                 tmp_path: Path) -> None:
    import math

    from minfer.gguf.hparams import HParams

    path = convert_hf(ckpts["phi3_longrope"], tmp_path / "l.gguf", outtype="f32",
                      progress=False)
    with GGUFFile.open(path) as f:
        assert list(f.metadata)[1] == "phi3.rope.scaling.attn_factor"  # the converter's order
        np.testing.assert_array_equal(f.array("rope_factors_long.weight"),
                                      np.float32([1.0, 1.5, 2.5, 4.0, 6.0, 8.0]))
        hp = HParams.from_gguf(f)
    assert (hp.longrope_ctx, hp.rope_dim, hp.qkv_fused, hp.ffn_up_gate) == (256, 12, True, True)
    assert hp.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))
