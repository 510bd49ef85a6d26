"""Finding a model's mmproj (vision encoder) as llama.cpp does: beside the model
(mmproj*.gguf, the quantization closest to the model's first), pulled with an `hf:` model as
`llama-server -hf` picks it (`--no-mmproj` to skip), and a file of another width refused by
name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from minfer.store.hub_select import quant_bits, rank_mmproj

FIXTURES = Path(__file__).parent / "fixtures"


def test_rank_mmproj_follows_find_best_sibling() -> None:
    assert [quant_bits(p) for p in ("m-Q4_K_M.gguf", "mmproj-F16.gguf", "x.gguf",
                                    "m-Q8_0-00001-of-00002.gguf", "mmproj-model-bf16.gguf")] \
        == [4, 16, 0, 8, 16]
    listing = ["README.md", "mmproj-F16.gguf", "mmproj-Q8_0.gguf", "sub/mmproj-Q4_0.gguf",
               "model-Q4_K_M.gguf", "sub/model-Q4_K_M.gguf", "other/mmproj-Q4_0.gguf"]
    # the model's own folder: Q8_0 is nearer 4 bits than F16; a subfolder is not above it
    assert rank_mmproj(listing, "model-Q4_K_M.gguf") == ["mmproj-Q8_0.gguf", "mmproj-F16.gguf"]
    # a model in a folder: its folder's first (deeper), then the root's
    assert rank_mmproj(listing, "sub/model-Q4_K_M.gguf") == [
        "sub/mmproj-Q4_0.gguf", "mmproj-Q8_0.gguf", "mmproj-F16.gguf"]
    assert rank_mmproj(listing, "model-F16.gguf")[0] == "mmproj-F16.gguf"
    assert rank_mmproj(["model.gguf"], "model.gguf") == []


def _folder(tmp_path: Path, model: str, mmprojs: dict[str, str]) -> Path:
    """The Gemma 3 fixture's text model as `model`, each mmproj name a copy of the named
    fixture's mmproj (both project to width 64)."""
    shutil.copy(FIXTURES / "vision" / "model.gguf", tmp_path / model)
    for name, fixture in mmprojs.items():
        shutil.copy(FIXTURES / fixture / "mmproj.gguf", tmp_path / name)
    return tmp_path / model


def test_beside_the_model_the_closest_quantization(tmp_path: Path) -> None:
    from minfer.api import Model

    mmprojs = {"mmproj-Q8_0.gguf": "vision", "mmproj-F16.gguf": "idefics3"}
    q8 = _folder(tmp_path, "model-Q8_0.gguf", mmprojs)
    shutil.copy(q8, tmp_path / "model-F16.gguf")
    vision = Model(q8, n_ctx=64).vision
    assert vision is not None and vision.params.projector == "gemma3"
    vision = Model(tmp_path / "model-F16.gguf", n_ctx=64).vision
    assert vision is not None and vision.params.projector == "idefics3"
    assert Model(q8, n_ctx=64, find_mmproj=False).vision is None
    (tmp_path / "mmproj-bad.gguf").write_bytes(b"not a gguf")  # skipped, not fatal
    assert Model(q8, n_ctx=64).vision is not None


def test_an_mmproj_of_another_width_is_refused_naming_both(tiny_qwen3moe: Path) -> None:
    from minfer.api import Model
    from minfer.errors import ModelError

    model = Model(tiny_qwen3moe, n_ctx=64, mmproj=FIXTURES / "vision" / "mmproj.gguf")
    with pytest.raises(ModelError, match=rf"mmproj\.gguf does not match {tiny_qwen3moe.name}"
                                         r".*width 64.*n_embd\) is 256"):
        _ = model.vision


def test_run_no_mmproj_refuses_the_image(capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    args = ["run", str(FIXTURES / "vision" / "model.gguf"), "hi", "-n", "1", "-c", "128",
            "--image", str(FIXTURES / "vision" / "image.png"), "--no-mmproj"]
    assert main(args) != 0
    assert "takes no images" in capsys.readouterr().err


@pytest.fixture
def vision_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from tests.fakehub import FakeHub, use_fake_hub

    model = (FIXTURES / "vision" / "model.gguf").read_bytes()
    mmproj = (FIXTURES / "vision" / "mmproj.gguf").read_bytes()
    files = {"README.md": b"# tiny vlm\n", "tiny-vlm-Q8_0.gguf": model,
             "mmproj-tiny-vlm-F16.gguf": b"the wrong one", "mmproj-tiny-vlm-Q8_0.gguf": mmproj,
             "extra/mmproj-tiny-vlm-Q8_0.gguf": b"in another folder"}
    fake = FakeHub({"org/tiny-vlm-GGUF": files}).start()
    use_fake_hub(monkeypatch, fake.url, tmp_path)
    yield fake
    fake.stop()


def _fetched(hub: object) -> set[str]:
    return {r.path.rsplit("/", 1)[-1] for r in hub.requests  # type: ignore[attr-defined]
            if r.method == "GET" and "/resolve/" in r.path}


def test_hf_pull_brings_the_mmproj_as_llama_server(vision_hub: object) -> None:
    """`hf:` pulls the model and the repo's mmproj llama.cpp would pick (same folder,
    quantization nearest the model's); the model then finds it beside itself."""
    from minfer.api import Model
    from minfer.store.hub import pull_hub

    path = pull_hub("hf:org/tiny-vlm-GGUF:Q8_0", progress=False)
    assert _fetched(vision_hub) == {"tiny-vlm-Q8_0.gguf", "mmproj-tiny-vlm-Q8_0.gguf"}
    assert (path.parent / "mmproj-tiny-vlm-Q8_0.gguf").is_file()
    vision = Model(path, n_ctx=64).vision
    assert vision is not None and vision.params.projector == "gemma3"


def test_hf_pull_no_mmproj(vision_hub: object, capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    assert main(["pull", "hf:org/tiny-vlm-GGUF:Q8_0", "--quiet", "--no-mmproj"]) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert _fetched(vision_hub) == {"tiny-vlm-Q8_0.gguf"}
    assert not list(path.parent.glob("mmproj*"))
