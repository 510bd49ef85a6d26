"""`minfer convert`: tiny random Hugging Face checkpoints against two independent references —
transformers' own forward (run through minfer for Qwen2/Qwen3, through llama.cpp for all four
families when it is importable) and llama.cpp's convert_hf_to_gguf.py (byte-identical files)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from minfer.cli.main import main
from minfer.convert import convert_hf
from minfer.convert.families import permute_rope
from minfer.gguf.reader import GGUFFile
from tests.hf_tiny import hf_logits, write_checkpoint
from tests.llama_convert import reference_convert
from tests.refpython import llama_python, run_json

# llama3: BPE + llama3 rope; qwen3_yarn: YaRN rope scaling
FAMILIES = ("qwen2", "qwen3", "llama", "gemma3", "llama3", "qwen3_yarn")
IDS = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: write_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def converted(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {f: convert_hf(d, root / f"{f}.gguf", outtype="f32", progress=False)
            for f, d in ckpts.items()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_yarn"])
def test_minfer_logits_match_transformers(family: str, ckpts: dict[str, Path],
                                          converted: dict[str, Path]) -> None:
    import minfer

    ref = hf_logits(ckpts[family], IDS)
    model = minfer.load(converted[family], n_ctx=64, backend="cpu", kv_type="f32")
    got = model.engine(len(IDS)).forward(IDS, 0)[0]
    # f32 weights and KV: only summation order differs (measured ~2e-7 on logits of ~1).
    assert np.abs(got - ref).max() < 1e-5 * max(1.0, float(np.abs(ref).max()))
    assert model.tokenizer.encode("<|im_start|>") == [318]  # the special survives conversion


OUTTYPE = {"qwen2": "f16", "qwen3": "bf16", "llama": "q8_0", "gemma3": "f16", "llama3": "f16",
           "qwen3_yarn": "f16"}
PRE = {"qwen2": "qwen2", "qwen3": "qwen2", "qwen3_yarn": "qwen2",
       "llama3": "llama-bpe"}  # BPE pre-tokenizer names


@pytest.fixture(scope="module")
def reference_files(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, Path]:
    """llama.cpp's converter output for each family (one outtype each, so all four are seen)."""
    root = tmp_path_factory.mktemp("ref")
    jobs = [(ckpts[f], root / f"{f}.gguf", OUTTYPE[f], PRE.get(f)) for f in FAMILIES]
    reference_convert(jobs)
    return {f: root / f"{f}.gguf" for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_same_bytes_as_llama_cpp_converter(family: str, ckpts: dict[str, Path],
                                           reference_files: dict[str, Path],
                                           tmp_path: Path) -> None:
    ref = reference_files[family]
    ours = convert_hf(ckpts[family], tmp_path / "ours.gguf", outtype=OUTTYPE[family],
                      progress=False)
    if ours.read_bytes() != ref.read_bytes():  # say where, before failing
        with GGUFFile.open(ours) as a, GGUFFile.open(ref) as b:
            keys = set(a.metadata.keys() ^ b.metadata.keys())
            keys |= {k for k in a.metadata.keys() & b.metadata.keys()
                     if str(a.metadata[k]) != str(b.metadata[k])}
            tensors = [n for n in a.tensors if n not in b.tensors
                       or a.tensors[n].type_name != b.tensors[n].type_name
                       or not np.array_equal(a.raw(n), b.raw(n))]
        pytest.fail(f"differs from llama.cpp: metadata {sorted(keys)}, tensors {tensors}")


_LLAMA_LOGITS = """
import json, sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=64, logits_all=True, verbose=False)
ids = json.loads(sys.argv[2])
m.eval(ids)
print(json.dumps([float(x) for x in m.scores[len(ids) - 1]]))
"""


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_it_like_transformers(family: str, ckpts: dict[str, Path],
                                             converted: dict[str, Path]) -> None:
    python = llama_python()
    ref = hf_logits(ckpts[family], IDS)
    got = np.array(run_json(python, _LLAMA_LOGITS, str(converted[family]), json.dumps(IDS)))
    # llama.cpp keeps its KV cache in f16: differences of ~1e-4 on logits of ~1.
    assert np.abs(got - ref).max() < 2e-3 * max(1.0, float(np.abs(ref).max()))


def test_family_fixups_in_the_file(ckpts: dict[str, Path], converted: dict[str, Path]) -> None:
    from safetensors.numpy import load_file

    hf = load_file(ckpts["llama"] / "model.safetensors")
    with GGUFFile.open(converted["llama"]) as f:
        q = hf["model.layers.0.self_attn.q_proj.weight"]
        k = hf["model.layers.0.self_attn.k_proj.weight"]
        assert np.array_equal(f.array("blk.0.attn_q.weight"), permute_rope(q, 4))
        assert np.array_equal(f.array("blk.0.attn_k.weight"), permute_rope(k, 2))
        assert f.metadata["llama.rope.dimension_count"] == 16
    hf = load_file(ckpts["gemma3"] / "model.safetensors")
    with GGUFFile.open(converted["gemma3"]) as f:
        norm = hf["model.layers.1.post_feedforward_layernorm.weight"]
        np.testing.assert_array_equal(f.array("blk.1.post_ffw_norm.weight"), norm + 1)
        assert f.metadata["gemma3.attention.sliding_window"] == 16
        assert f.metadata["tokenizer.ggml.model"] == "llama"
        assert f.metadata["tokenizer.chat_template"].startswith("{%- for message")


def test_bf16_checkpoint_converts_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ckpt = write_checkpoint(tmp_path / "q", "qwen3", dtype="bfloat16")
    out = convert_hf(ckpt, tmp_path / "q.gguf", outtype="bf16", progress=False)
    hf = load_file(ckpt / "model.safetensors")
    with GGUFFile.open(out) as f:
        assert f.tensors["blk.0.ffn_up.weight"].type_name == "BF16"
        want = hf["model.layers.0.mlp.up_proj.weight"].view(dtype=__import__("torch").int16)
        assert np.array_equal(f.array("blk.0.ffn_up.weight"), want.numpy().view(np.uint16))


def test_cli_convert_and_errors(ckpts: dict[str, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.gguf"
    assert main(["convert", str(ckpts["qwen2"]), str(out), "--outtype", "q8_0", "--quiet"]) == 0
    with GGUFFile.open(out) as f:
        assert f.tensors["blk.0.ffn_up.weight"].type_name == "Q8_0"
        assert f.tensors["blk.0.attn_norm.weight"].type_name == "F32"
        assert f.metadata["general.file_type"] == 7
    assert main(["convert", str(ckpts["qwen2"]), str(out)]) == 2  # exists
    odd = tmp_path / "odd"
    odd.mkdir()
    cfg = json.loads((ckpts["qwen2"] / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    assert main(["convert", str(odd), str(tmp_path / "x.gguf")]) == 2
    tok = json.loads((ckpts["qwen2"] / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"
    (odd / "config.json").write_text(json.dumps(cfg))
    (odd / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("model.safetensors", "tokenizer_config.json"):
        (odd / name).symlink_to(ckpts["qwen2"] / name)
    assert main(["convert", str(odd), str(tmp_path / "y.gguf")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "GPT2LMHeadModel" in err and "--tokenizer-pre" in err
    assert main(["convert", str(odd), str(tmp_path / "y.gguf"), "--tokenizer-pre", "qwen2",
                 "--quiet"]) == 0
    assert not list(tmp_path.glob("*.partial"))


def test_interrupted_convert_leaves_nothing(ckpts: dict[str, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import minfer.convert.convert as conv

    real, calls = conv._tensor_data, []

    def data_then_interrupt(*args: object) -> object:
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(conv, "_tensor_data", data_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_hf(ckpts["qwen2"], tmp_path / "i.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []
