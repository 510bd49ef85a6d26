"""`minfer convert` on BERT: a tiny random sentence-transformers folder and a cross-encoder,
against llama.cpp's converter (the same bytes at f32, f16 and q8_0) and transformers (the ids
its tokenizer gives, the mean-pooled embeddings), and `minfer embed` on the result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.cli.main import main
from minfer.convert import convert_hf
from minfer.gguf.reader import GGUFFile
from tests.hf_tiny import hf_mean_embeddings, write_bert_checkpoint
from tests.llama_convert import reference_convert

from .oracle import OracleBert

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello world", "Tea and a good book",
         "def main(): return 42", "Ünïcödé morning"]
OUTTYPES = ("f32", "f16", "q8_0")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert")
    return {"st": write_bert_checkpoint(root / "st"),
            "ranker": write_bert_checkpoint(root / "ranker", classifier=True)}


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ref")
    jobs = {(k, t): root / f"{k}-{t}.gguf" for k in folders for t in OUTTYPES}
    reference_convert([(folders[k], out, t, "default") for (k, t), out in jobs.items()])
    return jobs


@pytest.mark.parametrize("kind", ["st", "ranker"])
@pytest.mark.parametrize("outtype", OUTTYPES)
def test_same_bytes_as_llama_cpp_converter(kind: str, outtype: str, folders: dict[str, Path],
                                           reference: dict[tuple[str, str], Path],
                                           tmp_path: Path) -> None:
    ours = convert_hf(folders[kind], tmp_path / "ours.gguf", outtype=outtype, progress=False)
    ref = reference[(kind, outtype)]
    if ours.read_bytes() != ref.read_bytes():
        with GGUFFile.open(ours) as a, GGUFFile.open(ref) as b:
            keys = sorted(a.metadata.keys() ^ b.metadata.keys()) + sorted(
                k for k in a.metadata.keys() & b.metadata.keys()
                if str(a.metadata[k]) != str(b.metadata[k]))
            tensors = [n for n in a.tensors if n not in b.tensors
                       or not np.array_equal(a.raw(n), b.raw(n))]
        pytest.fail(f"differs from llama.cpp: metadata {keys}, tensors {tensors}")


def test_embeddings_match_transformers(folders: dict[str, Path], tmp_path: Path) -> None:
    path = convert_hf(folders["st"], tmp_path / "st.gguf", outtype="f32", progress=False)
    ref, hf_ids = hf_mean_embeddings(folders["st"], TEXTS)
    model = minfer.load(path)
    assert [model.tokenizer.encode(t) for t in TEXTS] == hf_ids
    with GGUFFile.open(path) as f:
        assert f.metadata["bert.pooling_type"] == 1
    got = model.embed(TEXTS, normalize=-1)
    np.testing.assert_allclose(got, ref, atol=5e-5)
    unit = model.embed(TEXTS)
    np.testing.assert_allclose(unit, ref / np.linalg.norm(ref, axis=1, keepdims=True),
                               atol=1e-5)


def test_cross_encoder_scores_with_its_head(folders: dict[str, Path], tmp_path: Path) -> None:
    """The classifier becomes `cls.output` (llama.cpp drops BERT's pooler): rerank scores are
    the float64 oracle's for the same file and pair layout."""
    path = convert_hf(folders["ranker"], tmp_path / "ranker.gguf", outtype="f32",
                      progress=False)
    model = minfer.load(path)
    assert model.hparams.n_cls_out == 1 and not model.hparams.has_cls_dense
    scores = model.rerank("fox", TEXTS)
    pair = model.embedder("rank").encode_pair("fox", TEXTS[0])
    ref = OracleBert(str(path)).pool(pair.ids, "rank", pair.types)
    assert scores[0] == pytest.approx(float(ref[0]), abs=1e-5)


def test_cli_embed_writes_json_lines(folders: dict[str, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = convert_hf(folders["st"], tmp_path / "st.gguf", outtype="f16", progress=False)
    lines = tmp_path / "texts.txt"
    lines.write_text("hello world\n\nTea and a good book\n")
    assert main(["embed", str(path), "the fox", "--file", str(lines)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    vecs = np.array([r["embedding"] for r in rows])
    assert vecs.shape == (3, 64) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0)
    assert main(["embed", str(path), "the fox", "--embd-normalize", "-1"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["n_tokens"] == 4 and np.linalg.norm(raw["embedding"]) > 1.5
    assert main(["embed", str(path), "x", "--rerank", "q"]) == 2
    assert "rank pooling" in capsys.readouterr().err
    assert main(["embed", str(path)]) == 2
    assert "nothing to embed" in capsys.readouterr().err


def test_a_qwen3_embedding_folder_keeps_its_pooling(tmp_path: Path) -> None:
    """A Qwen3 checkpoint with a sentence-transformers last-token Pooling module (Qwen3-Embedding's
    layout): `qwen3.pooling_type` = last, as llama.cpp's converter writes it (same bytes), and
    the model embeds through its last token with no --pooling."""
    from tests.hf_tiny import write_checkpoint

    folder = write_checkpoint(tmp_path / "qwen3emb", "qwen3")
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": 1, "name": "1", "path": "1_Pooling",
          "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}))
    ref = tmp_path / "ref.gguf"
    reference_convert([(folder, ref, "f32", "qwen2")])
    ours = convert_hf(folder, tmp_path / "ours.gguf", outtype="f32", progress=False)
    assert ours.read_bytes() == ref.read_bytes()
    model = minfer.load(ours)
    assert model.hparams.pooling == "last"
    assert model.embed(["hello", "world"]).shape == (2, 64)
