"""Pulling GGUF models from a (fake, local) Hugging Face Hub: the llama.cpp `-hf` file pick,
split sets fetched whole, sha256 checks, resume, the cache, `minfer list` and `minfer run`."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from minfer.cli.main import main
from minfer.errors import DownloadError, ModelNotFoundError
from minfer.gguf.reader import GGUFFile
from minfer.store import list_models, resolve_model
from minfer.store.hub import cached_hub_model, pull_hub
from minfer.store.hub_select import HubFile, parse_hub_ref, select_files
from minfer.tools.split import split_gguf
from tests.fakehub import COMMIT, FakeHub, use_fake_hub

REPO = "org/tiny-GGUF"


def _pick(paths: list[str], selector: str) -> list[str]:
    ref = parse_hub_ref(f"hf:{REPO}" + (f":{selector}" if selector else ""))
    return [f.path for f in select_files([HubFile(p) for p in paths], ref)]


def test_select_follows_llama_cpp_rule() -> None:
    listing = ["README.md", "mmproj-tiny-Q4_K_M.gguf", "tiny-IQ2_XS.gguf",
               "Q8_0/tiny-Q8_0-00002-of-00002.gguf", "Q8_0/tiny-Q8_0-00001-of-00002.gguf",
               "tiny-Q4_K_M.gguf", "tiny-q5_k_m.gguf"]
    assert _pick(listing, "Q4_K_M") == ["tiny-Q4_K_M.gguf"]  # the mmproj sidecar is skipped
    assert _pick(listing, "Q5_K_M") == ["tiny-q5_k_m.gguf"]  # case-insensitive
    assert _pick(listing, "q8_0") == ["Q8_0/tiny-Q8_0-00001-of-00002.gguf",
                                      "Q8_0/tiny-Q8_0-00002-of-00002.gguf"]
    assert _pick(listing, "") == ["tiny-Q4_K_M.gguf"]  # default tags: Q4_K_M, then Q8_0
    assert _pick(listing[:5], "") == _pick(listing, "Q8_0")
    assert _pick(listing[:3], "") == ["tiny-IQ2_XS.gguf"]  # else the first model file
    assert _pick(listing, "tiny-IQ2_XS.gguf") == ["tiny-IQ2_XS.gguf"]
    with pytest.raises(ModelNotFoundError, match=r"no matching GGUF.*tiny-IQ2_XS\.gguf"):
        _pick(listing, "Q6_K")
    with pytest.raises(ModelNotFoundError, match="incomplete"):
        _pick(listing[4:5], "Q8_0")
    with pytest.raises(ModelNotFoundError, match="expected hf:ORG/REPO"):
        parse_hub_ref("hf:no-slash")


@pytest.fixture
def hub(tmp_path: Path, tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fake Hub holding tiny_qwen2 as a Q4_K_M file and a two-part Q8_0 split set."""
    parts = split_gguf(tiny_qwen2, tmp_path / "split" / "tiny-Q8_0", max_tensors=13,
                       progress=False)
    assert len(parts) == 2
    files = {"README.md": b"# tiny\n", "mmproj-tiny-f16.gguf": b"not a model",
             "tiny-Q4_K_M.gguf": tiny_qwen2.read_bytes()}
    files |= {f"Q8_0/{p.name}": p.read_bytes() for p, _ in parts}
    fake = FakeHub({REPO: files}).start()
    use_fake_hub(monkeypatch, fake.url, tmp_path)
    yield fake
    fake.stop()


def test_pull_quant_tag_into_hub_cache(hub: FakeHub, tmp_path: Path, tiny_qwen2: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    path = pull_hub(f"hf:{REPO}:Q4_K_M", progress=False)
    assert path == (tmp_path / "hf" / "hub" / "models--org--tiny-GGUF" / "snapshots" / COMMIT
                    / "tiny-Q4_K_M.gguf")
    assert path.read_bytes() == tiny_qwen2.read_bytes()
    gets = [r for r in hub.requests if "/resolve/" in r.path]
    # the repo's mmproj comes with the model, as `llama-server -hf` pulls it
    assert {r.path.rsplit("/", 1)[-1] for r in gets} == {"tiny-Q4_K_M.gguf",
                                                         "mmproj-tiny-f16.gguf"}
    assert all(r.auth == "Bearer hf_secret" for r in hub.requests)
    n = len(hub.requests)
    assert resolve_model(f"hf:{REPO}:Q4_K_M") == path  # from the cache: no request
    assert pull_hub(f"hf:{REPO}:Q4_K_M", progress=False) == path  # listed again, not fetched
    assert [r.method for r in hub.requests[n:]] == ["GET"]


def test_split_set_fetched_whole_and_listed(hub: FakeHub, tiny_qwen2: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["pull", f"hf:{REPO}:Q8_0", "--quiet"]) == 0
    first = Path(capsys.readouterr().out.strip())
    assert first.name == "tiny-Q8_0-00001-of-00002.gguf"
    with GGUFFile.open(first) as split, GGUFFile.open(tiny_qwen2) as whole:
        assert all((split.raw(n) == whole.raw(n)).all() for n in whole.tensors)
    names = [m.name for m in list_models()]
    assert names == [f"hf:{REPO}:Q8_0/tiny-Q8_0-00001-of-00002.gguf"]
    assert list_models()[0].architecture == "qwen2"
    assert main(["list"]) == 0
    assert "hf:org/tiny-GGUF:Q8_0/tiny-Q8_0-00001-of-00002.gguf" in capsys.readouterr().out


def test_checksum_mismatch_refused_and_removed(hub: FakeHub) -> None:
    hub.corrupt.add("tiny-Q4_K_M.gguf")
    with pytest.raises(DownloadError, match="fails its checksum"):
        pull_hub(f"hf:{REPO}:Q4_K_M", progress=False)
    assert cached_hub_model(f"hf:{REPO}:Q4_K_M") is None
    hub.corrupt.clear()
    assert pull_hub(f"hf:{REPO}:Q4_K_M", progress=False).is_file()


def test_interrupted_download_resumes_with_range(hub: FakeHub, tiny_qwen2: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # Chunks smaller than the file, so the bytes before the cut reach the .incomplete blob.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.cut_once.add("tiny-Q4_K_M.gguf")
    try:
        path = pull_hub(f"hf:{REPO}:Q4_K_M", progress=False)
    except DownloadError:  # huggingface_hub gave up on the cut connection: pull again
        assert cached_hub_model(f"hf:{REPO}:Q4_K_M") is None
        path = pull_hub(f"hf:{REPO}:Q4_K_M", progress=False)
    assert path.read_bytes() == tiny_qwen2.read_bytes()
    ranges = [r.range for r in hub.requests
              if r.method == "GET" and r.path.endswith("/tiny-Q4_K_M.gguf")]
    assert ranges[0] is None and ranges[-1] is not None and ranges[-1] != "bytes=0-"


def test_errors_are_one_line(hub: FakeHub, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["pull", "hf:org/missing", "--quiet"]) == 2
    assert main(["pull", f"hf:{REPO}:Q6_K", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no such repository" in err and "no matching GGUF" in err
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    with pytest.raises(DownloadError, match=r"hf:org/tiny-GGUF:Q4_K_M: \w+"):
        pull_hub(f"hf:{REPO}:Q4_K_M", progress=False)


def test_run_hub_model_argument(hub: FakeHub, tmp_path: Path) -> None:
    dot = tmp_path / "g.dot"  # --dump-graph: the model is resolved and loaded, nothing compiled
    assert main(["run", f"hf:{REPO}:Q4_K_M", "hi", "--raw", "--dump-graph", str(dot)]) == 0
    assert "digraph" in dot.read_text()
    assert any("tiny-Q4_K_M.gguf" in r.path for r in hub.requests)


def test_a_catalogue_hub_entry_is_fetched_on_first_use(
        hub: FakeHub, tmp_path: Path, tiny_qwen2: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalogue name that is a Hub file (`qwen3:0.6b`-style) resolves through the Hub's
    cache: fetched on first use (saying so), from the cache afterwards; `minfer pull` too."""
    import json

    catalog = {"default": "tiny:q4", "models": {"tiny:q4": {
        "description": "tiny", "hub": f"hf:{REPO}:tiny-Q4_K_M.gguf"}}}
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    monkeypatch.setenv("MINFER_CATALOG", str(tmp_path / "catalog.json"))
    path = resolve_model("tiny:q4")
    assert path.read_bytes() == tiny_qwen2.read_bytes() and "snapshots" in str(path)
    assert f"tiny:q4 is not downloaded yet: pulling it (hf:{REPO}" in capsys.readouterr().err
    n = len(hub.requests)
    assert resolve_model("tiny:q4") == resolve_model(None) == path
    assert len(hub.requests) == n and capsys.readouterr().err == ""
    assert main(["pull", "tiny:q4", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(path)
