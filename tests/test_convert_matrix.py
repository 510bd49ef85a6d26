"""`minfer convert` against llama.cpp 0.3.36's convert_hf_to_gguf.py on every family minfer
runs, at every `--outtype`: byte-identical files.

Each case is a tiny random transformers 5.x checkpoint (tests/hf_tiny.py) with its tokenizer
and a chat template, one config variant per case (tied / untied output, rope scaling where the
family has it, SentencePiece or byte-level BPE). llama.cpp's side converts every case at every
outtype in one interpreter, once per session; a difference is described (metadata keys, their
order, types and values; tensors, their order, names, types, shapes and data) before failing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from minfer.convert import OUTTYPES, convert_hf
from minfer.gguf.reader import GGUFFile
from tests.hf_tiny import (
    write_bert_checkpoint,
    write_bpe_tokenizer,
    write_checkpoint,
    write_reranker_checkpoint,
)
from tests.llama_convert import reference_convert

_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _ckpt(family: str, **kw: Any) -> Callable[[Path], Path]:
    return lambda d: write_checkpoint(d, family, **kw)


# case → (checkpoint writer, the BPE / WordPiece pre-tokenizer name the tiny tokenizer is
# given: its hash is unknown to llama.cpp). Byte-level BPE tokenizers carry the post-processor
# their family's real ones have; some checkpoints are bf16 and carry sampling defaults in
# generation_config.json, as real ones do; some spell their rope settings as transformers 4 did.
CASES: dict[str, tuple[Callable[[Path], Path], str | None]] = {
    "qwen2": (_ckpt("qwen2", post_processor="bytelevel", dtype="bfloat16",
                    generation=_SAMPLING), "qwen2"),
    "qwen3": (_ckpt("qwen3", post_processor="bytelevel"), "qwen2"),
    "qwen3_yarn": (_ckpt("qwen3_yarn", post_processor="bytelevel"), "qwen2"),
    "qwen3_yarn_legacy": (_ckpt("qwen3_yarn", post_processor="bytelevel", legacy=True),
                          "qwen2"),
    "llama2": (_ckpt("llama"), None),
    "llama3": (_ckpt("llama3", post_processor="bos", generation=_SAMPLING), "llama-bpe"),
    "mistral": (_ckpt("mistral", dtype="bfloat16"), None),
    "tinyllama": (_ckpt("tinyllama", legacy=True), None),
    "llama3_legacy": (_ckpt("llama3", post_processor="bos", legacy=True), "llama-bpe"),
    "gemma3": (_ckpt("gemma3", dtype="bfloat16", generation={"top_k": 64, "top_p": 0.95}),
               None),
    "gemma3_scaled": (_ckpt("gemma3_scaled"), None),
    "gemma3_legacy": (_ckpt("gemma3_scaled", legacy=True), None),
    "qwen2moe": (_ckpt("qwen2moe", post_processor="bytelevel"), "qwen2"),
    "qwen3moe": (_ckpt("qwen3moe", post_processor="bytelevel", dtype="bfloat16",
                       generation=_SAMPLING), "qwen2"),
    "mixtral": (_ckpt("mixtral"), None),
    "smollm3": (_ckpt("smollm3", post_processor="bytelevel"), "llama-bpe"),
    "phi3": (_ckpt("phi3", post_processor="bytelevel"), "qwen2"),
    "phi3_longrope": (_ckpt("phi3_longrope"), None),
    "lfm2": (_ckpt("lfm2", post_processor="bytelevel"), "qwen2"),
    "qwen35": (_ckpt("qwen35", post_processor="bytelevel"), "qwen2"),
    "qwen35moe": (_ckpt("qwen35moe", post_processor="bytelevel", dtype="bfloat16"), "qwen2"),
    "bert": (write_bert_checkpoint, "default"),
    "qwen3_reranker": (write_reranker_checkpoint, "qwen2"),
}


# llama.cpp's converter wants --no-mtp for a Qwen3.5 checkpoint without an MTP block
NO_MTP, NO_MTP_CASES = ("--no-mtp",), ("qwen35", "qwen35moe")


def gguf_differences(ours: Path, ref: Path) -> list[str]:
    """What differs between two GGUF files, field by field ([] when the bytes are equal)."""
    from gguf import GGUFReader

    if ours.read_bytes() == ref.read_bytes():
        return []
    a, b = GGUFReader(ours), GGUFReader(ref)
    out = []
    ka, kb = list(a.fields), list(b.fields)
    if missing := [k for k in kb if k not in ka]:
        out.append(f"keys missing: {missing}")
    if extra := [k for k in ka if k not in kb]:
        out.append(f"keys not in llama.cpp's: {extra}")
    common_a = [k for k in ka if k in kb]
    if common_a != [k for k in kb if k in ka]:
        out.append(f"key order: {ka} vs {kb}")
    for k in common_a:
        fa, fb = a.fields[k], b.fields[k]
        if fa.types != fb.types:
            out.append(f"{k}: types {fa.types} vs {fb.types}")
        elif [bytes(p) for p in fa.parts] != [bytes(p) for p in fb.parts]:
            va, vb = fa.contents(), fb.contents()
            if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
                idx = next((i for i, (x, y) in enumerate(zip(va, vb, strict=True)) if x != y),
                           None)
                if idx is None:
                    out.append(f"{k}: same values, different bytes")
                else:
                    out.append(f"{k}[{idx}]: {va[idx]!r} vs {vb[idx]!r}")
            else:
                out.append(f"{k}: {str(va)[:200]!r} vs {str(vb)[:200]!r}")
    ta, tb = [t.name for t in a.tensors], [t.name for t in b.tensors]
    if ta != tb:
        out.append(f"tensor names / order: {ta} vs {tb}")
    tb_by = {t.name: t for t in b.tensors}
    shifted = False  # the data section moves with the header: its first shift says enough
    for t in a.tensors:
        if (u := tb_by.get(t.name)) is None:
            continue
        if t.tensor_type != u.tensor_type or list(t.shape) != list(u.shape):
            out.append(f"{t.name}: {t.tensor_type.name}{list(t.shape)} vs "
                       f"{u.tensor_type.name}{list(u.shape)}")
        elif bytes(t.data) != bytes(u.data):
            out.append(f"{t.name}: data")
        elif t.data_offset != u.data_offset and not shifted:
            shifted = True
            out.append(f"{t.name}: file offset {t.data_offset} vs {u.data_offset}")
    return out or ["bytes differ (header or padding)"]


@pytest.fixture(scope="session")
def matrix_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("matrix-hf")
    # the folder name says "qwen3-reranker": llama.cpp's converter recognises one by it
    return {case: write(root / ("qwen3-reranker-tiny" if case == "qwen3_reranker" else case))
            for case, (write, _) in CASES.items()}


@pytest.fixture(scope="session")
def matrix_reference(matrix_ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                     ) -> dict[tuple[str, str], Path]:
    """llama.cpp's file for every (case, outtype), all made in one interpreter."""
    root = tmp_path_factory.mktemp("matrix-ref")
    jobs = {(c, t): root / f"{c}-{t}.gguf" for c in CASES for t in OUTTYPES}
    reference_convert([(matrix_ckpts[c], out, t, CASES[c][1]) for (c, t), out in jobs.items()],
                      flags={matrix_ckpts[c]: NO_MTP for c in NO_MTP_CASES})
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("outtype", tuple(OUTTYPES))
@pytest.mark.parametrize("case", tuple(CASES))
def test_same_bytes_as_llama_cpp(case: str, outtype: str, matrix_ckpts: dict[str, Path],
                                 matrix_reference: dict[tuple[str, str], Path],
                                 tmp_path: Path) -> None:
    ours = convert_hf(matrix_ckpts[case], tmp_path / "ours.gguf", outtype=outtype,
                      tokenizer_pre=CASES[case][1], progress=False)
    diffs = gguf_differences(ours, matrix_reference[(case, outtype)])
    assert not diffs, f"{case} {outtype} differs from llama.cpp:\n" + "\n".join(diffs)


def test_experts_stacked_per_layer_in_llama_cpps_order(tmp_path: Path) -> None:
    """A hand-made Qwen2-MoE checkpoint (no transformers needed): each layer's experts become
    one 3-D tensor per projection, written where the layer's last expert tensor is read, down /
    gate / up; the routers stay f32 at q8_0; the expert counts and the size label say so."""
    n_vocab, n_embd, n_ff, n_expert = write_bpe_tokenizer(tmp_path), 64, 32, 3
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": (n_vocab, n_embd),
               "lm_head.weight": (n_vocab, n_embd), "model.norm.weight": (n_embd,)}
    for b in range(2):
        pre = f"model.layers.{b}."
        tensors |= {pre + "input_layernorm.weight": (n_embd,),
                    pre + "post_attention_layernorm.weight": (n_embd,),
                    pre + "mlp.gate.weight": (n_expert, n_embd),
                    pre + "mlp.shared_expert_gate.weight": (1, n_embd)}
        for p in ("q", "k", "v", "o"):
            tensors[pre + f"self_attn.{p}_proj.weight"] = (n_embd, n_embd)
        for x in range(n_expert):
            for proj, shape in (("gate_proj", (n_ff, n_embd)), ("up_proj", (n_ff, n_embd)),
                                ("down_proj", (n_embd, n_ff))):
                tensors[pre + f"mlp.experts.{x}.{proj}.weight"] = shape
        for proj, shape in (("gate_proj", (n_ff, n_embd)), ("up_proj", (n_ff, n_embd)),
                            ("down_proj", (n_embd, n_ff))):
            tensors[pre + f"mlp.shared_expert.{proj}.weight"] = shape
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in tensors.items()}
    save_file(arrays, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": n_vocab, "hidden_size": n_embd,
        "intermediate_size": 128, "moe_intermediate_size": n_ff,
        "shared_expert_intermediate_size": n_ff, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": n_expert,
        "num_experts_per_tok": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": False}))
    out = convert_hf(tmp_path, tmp_path / "moe.gguf", outtype="q8_0", progress=False)
    with GGUFFile.open(out) as f:
        names = list(f.tensors)
        block0 = [n.removeprefix("blk.0.") for n in names if n.startswith("blk.0.")]
        assert block0[:4] == ["attn_norm.weight", "ffn_down_exps.weight",
                              "ffn_gate_exps.weight", "ffn_up_exps.weight"]
        assert f.tensors["blk.0.ffn_gate_inp.weight"].type_name == "F32"
        assert f.tensors["blk.0.ffn_gate_inp_shexp.weight"].type_name == "F32"
        assert f.tensors["blk.1.ffn_down_exps.weight"].type_name == "Q8_0"
        assert f.metadata["qwen2moe.expert_count"] == n_expert
        assert f.metadata["qwen2moe.expert_used_count"] == 2
        assert f.metadata["qwen2moe.expert_feed_forward_length"] == n_ff
        assert f.metadata["general.size_label"].startswith(f"{n_expert}x")
    out = convert_hf(tmp_path, tmp_path / "moe32.gguf", outtype="f32", progress=False)
    with GGUFFile.open(out) as f:
        want = np.stack([arrays[f"model.layers.1.mlp.experts.{x}.up_proj.weight"]
                         for x in range(n_expert)])
        np.testing.assert_array_equal(f.array("blk.1.ffn_up_exps.weight"), want)
