"""`minfer convert` of a Qwen3-Reranker checkpoint (`tests.hf_tiny.write_reranker_checkpoint`):
the file llama.cpp's converter writes, byte for byte, with the output tied to the embedding
and not (rank pooling, the labels, the `rerank` template, the head `cls.output`); minfer's
scores on it are transformers' P(yes) at the last token; a plain Qwen3 stays a causal LM."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.convert import convert_hf
from minfer.convert.checkpoint import CheckpointError
from minfer.convert.families import qwen3_reranker
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from tests.hf_tiny import write_reranker_checkpoint
from tests.llama_convert import reference_convert

FIXTURE = Path(__file__).parent / "fixtures" / "rerank" / "qwen3_reranker.gguf"
OUTTYPE = {"tied": "f16", "untied": "q8_0"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerank")
    return {"tied": write_reranker_checkpoint(root / "qwen3-reranker-tiny"),
            "untied": write_reranker_checkpoint(root / "Qwen3-Reranker-untied", tied=False,
                                                seed=1)}


@pytest.fixture(scope="module")
def reference_files(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerank-ref")
    reference_convert([(ckpts[k], root / f"{k}.gguf", OUTTYPE[k], "qwen2") for k in ckpts])
    return {k: root / f"{k}.gguf" for k in ckpts}


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_same_bytes_as_llama_cpp_converter(kind: str, ckpts: dict[str, Path],
                                           reference_files: dict[str, Path],
                                           tmp_path: Path) -> None:
    ours = convert_hf(ckpts[kind], tmp_path / "ours.gguf", outtype=OUTTYPE[kind],
                      tokenizer_pre="qwen2", progress=False)
    with GGUFFile.open(ours) as f:
        hp = HParams.from_gguf(f)
        assert (hp.pooling, hp.n_cls_out, hp.reranker) == ("rank", 2, True)
        assert ("output.weight" in f.tensors) is False  # tied: the embedding; untied: dropped
        assert "{document}" in f.metadata["tokenizer.chat_template.rerank"]
    assert ours.read_bytes() == reference_files[kind].read_bytes()


def test_the_committed_fixture_is_what_minfer_writes(ckpts: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """tests/fixtures/rerank was written by llama.cpp's converter from this very checkpoint."""
    ours = convert_hf(ckpts["tied"], tmp_path / "f32.gguf", outtype="f32",
                      tokenizer_pre="qwen2", progress=False)
    assert ours.read_bytes() == FIXTURE.read_bytes()


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_scores_are_transformers(kind: str, ckpts: dict[str, Path], tmp_path: Path) -> None:
    """The score is P(yes) against "no" at the prompt's last token, as Qwen3-Reranker's model
    card computes it from the causal LM's logits (f32 weights and KV: rounding only)."""
    import torch
    import transformers as tf

    path = convert_hf(ckpts[kind], tmp_path / "f32.gguf", outtype="f32",
                      tokenizer_pre="qwen2", progress=False)
    embedder = minfer.load(path, kv_type="f32").embedder()
    tokens = list(GGUFFile.open(path).metadata["tokenizer.ggml.tokens"])
    yes, no = tokens.index("yes"), tokens.index("no")
    model = tf.AutoModelForCausalLM.from_pretrained(ckpts[kind], dtype=torch.float32).eval()
    docs = ["The quick brown fox jumps over the lazy dog.", "def main(): return 42"]
    for ids in embedder.rerank_inputs("what is a fox", docs):
        with torch.no_grad():
            logits = model(torch.tensor([ids.ids])).logits[0, -1].double()
        want = torch.softmax(logits[[yes, no]], 0).numpy()
        got = embedder.run([ids])[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_which_checkpoints_are_rerankers(tmp_path: Path) -> None:
    """llama.cpp's tests: the README's title, a name (folder, `_name_or_path`, model type,
    architecture), a sequence-classification architecture; a plain Qwen3 is none."""
    plain = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert not qwen3_reranker(folder, plain)
    assert qwen3_reranker(folder, {**plain, "_name_or_path": "Qwen/Qwen3-Reranker-0.6B"})
    assert qwen3_reranker(folder, {**plain, "architectures": ["Qwen3ForSequenceClassification"]})
    assert qwen3_reranker(tmp_path / "qwen3-reranker-4b", plain)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Qwen3-Reranker-8B\n")
    assert qwen3_reranker(folder, plain)


def test_a_reranker_without_its_labels_is_refused(ckpts: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """The head needs the vocabulary's "yes" and "no": a clear error, no file."""
    folder = tmp_path / "qwen3-reranker-novocab"
    folder.mkdir()
    for f in ckpts["tied"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] not in ("yes", "no")]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match="'yes'"):
        convert_hf(folder, tmp_path / "out.gguf", outtype="f32", tokenizer_pre="qwen2",
                   progress=False)
    assert not (tmp_path / "out.gguf").exists()
