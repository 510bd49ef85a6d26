"""`minfer convert` against llama.cpp 0.3.36's convert_hf_to_gguf.py on every family minfer
runs, at every `--outtype`: byte-identical files.

Each case is a tiny random transformers 5.x checkpoint (tests/hf_tiny.py) with its tokenizer
and a chat template, one config variant per case (tied / untied output, rope scaling where the
family has it, SentencePiece or byte-level BPE). llama.cpp's side converts every case at every
outtype in one interpreter, once per session; a difference is described (metadata keys, their
order, types and values; tensors, their order, names, types, shapes and data) before failing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minfer.convert import OUTTYPES, convert_hf
from tests.hf_tiny import write_bert_checkpoint, write_checkpoint, write_reranker_checkpoint
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
    "bert": (write_bert_checkpoint, "default"),
    "qwen3_reranker": (write_reranker_checkpoint, "qwen2"),
}


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
    reference_convert([(matrix_ckpts[c], out, t, CASES[c][1]) for (c, t), out in jobs.items()])
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
