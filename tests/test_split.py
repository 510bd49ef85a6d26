"""`minfer split` / `minfer merge`: llama-gguf-split's layout, minfer and llama.cpp load the
parts, and merging gives back the input byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from minfer.cli.main import main
from minfer.gguf.reader import GGUFFile
from minfer.tools.split import SplitError, merge_gguf, parse_size, plan_split, split_gguf
from tests.refpython import llama_python, run_json


def _tensor_bytes(path: Path) -> dict[str, bytes]:
    with GGUFFile.open(path) as f:
        return {name: f.raw(name).tobytes() for name in f.tensors}


def test_split_by_tensors_layout_and_merge_identical(tiny_qwen2: Path, tmp_path: Path) -> None:
    parts = split_gguf(tiny_qwen2, tmp_path / "m.gguf", max_tensors=7, progress=False)
    n_tensors = len(GGUFFile.open(tiny_qwen2).tensors)
    assert len(parts) == -(-n_tensors // 7) >= 3
    names = [p.name for p, _ in parts]
    assert names[0] == f"m-00001-of-{len(parts):05d}.gguf"
    assert names[-1] == f"m-{len(parts):05d}-of-{len(parts):05d}.gguf"
    original = GGUFReader(tiny_qwen2)
    for i, (path, _) in enumerate(parts):
        r = GGUFReader(path)  # gguf-py reads each part as a valid GGUF on its own
        keys = [f.name for f in r.fields.values() if not f.name.startswith("GGUF.")]
        assert keys[-3:] == ["split.no", "split.count", "split.tensors.count"]
        assert r.fields["split.no"].parts[-1][0] == i
        assert r.fields["split.count"].parts[-1][0] == len(parts)
        assert r.fields["split.tensors.count"].parts[-1][0] == n_tensors
        if i == 0:
            assert keys[:-3] == [f.name for f in original.fields.values()
                                 if not f.name.startswith("GGUF.")]
        else:
            assert len(keys) == 3
    assert _tensor_bytes(parts[0][0]) == _tensor_bytes(tiny_qwen2)
    merged = merge_gguf(parts[0][0], tmp_path / "merged.gguf", progress=False)
    assert merged.read_bytes() == tiny_qwen2.read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_split_by_size_plan(tiny_qwen3: Path, tmp_path: Path) -> None:
    with GGUFFile.open(tiny_qwen3) as f:
        tensors = list(f.tensors.values())
    limit = 200_000
    groups = plan_split(tensors, max_bytes=limit)
    assert [t for g in groups for t in g] == tensors
    for g in groups:  # a part passes the limit only when it holds a single larger tensor
        size = sum(-(-t.nbytes // 32) * 32 for t in g)
        assert size <= limit or len(g) == 1
    parts = split_gguf(tiny_qwen3, tmp_path / "s", max_bytes=limit, progress=False)
    assert len(parts) == len(groups)
    merge_gguf(parts[0][0], tmp_path / "back.gguf", progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == tiny_qwen3.read_bytes()


def test_no_tensor_first_split_and_parse_size() -> None:
    assert parse_size("200M") == 200_000_000 and parse_size("4G") == 4 * 10**9
    with pytest.raises(SplitError, match="bad size"):
        parse_size("12X")
    assert plan_split([], max_tensors=2, no_tensor_first=True) == [[], []]


def test_minfer_runs_the_split_set(tiny_qwen2: Path, tmp_path: Path) -> None:
    import minfer

    parts = split_gguf(tiny_qwen2, tmp_path / "q", max_tensors=10, progress=False)
    ids = [1, 2, 3, 4, 5]
    whole = minfer.load(tiny_qwen2, n_ctx=64, backend="cpu").engine(5).forward(ids, 0)[0]
    split = minfer.load(parts[0][0], n_ctx=64, backend="cpu").engine(5).forward(ids, 0)[0]
    np.testing.assert_array_equal(whole, split)


def test_cli_split_merge_and_errors(tiny_qwen2: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["split", str(tiny_qwen2), str(tmp_path / "c"), "--split-max-size", "1K"]) == 0
    out, err = capsys.readouterr()
    first = tmp_path / f"c-00001-of-{len(out.splitlines()):05d}.gguf"
    assert first.is_file() and len(out.splitlines()) > 3
    assert len(err.strip().splitlines()) == 1 and err.startswith("split qwen2.gguf:")
    assert main(["merge", str(first), str(tmp_path / "c.gguf"), "--quiet"]) == 0
    assert (tmp_path / "c.gguf").read_bytes() == tiny_qwen2.read_bytes()
    capsys.readouterr()
    assert main(["merge", str(first), str(tmp_path / "c.gguf")]) == 2  # exists
    assert main(["merge", str(tiny_qwen2), str(tmp_path / "x.gguf")]) == 2  # not a split set
    second = first.with_name(first.name.replace("00001-of", "00002-of"))
    assert main(["merge", str(second), str(tmp_path / "y.gguf")]) == 2  # not the first part
    err = capsys.readouterr().err
    assert "already exists" in err and "not a split set" in err and "open c-00001" in err
    second.unlink()
    assert main(["info", str(first)]) == 2
    assert "missing" in capsys.readouterr().err


_LLAMA_LOGITS = """
import json, sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=64, logits_all=True, verbose=False)
m.eval([1, 2, 3, 4, 5])
print(json.dumps([float(x) for x in m.scores[4][:50]]))
"""


def test_llama_cpp_loads_the_split_set(tiny_qwen2: Path, tmp_path: Path) -> None:
    python = llama_python()
    parts = split_gguf(tiny_qwen2, tmp_path / "l", max_tensors=9, progress=False)
    whole = run_json(python, _LLAMA_LOGITS, str(tiny_qwen2))
    split = run_json(python, _LLAMA_LOGITS, str(parts[0][0]))
    assert whole == split and max(abs(x) for x in whole) > 0


def test_interrupted_split_leaves_nothing(tiny_qwen2: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import minfer.tools.split as split

    real, calls = split._copy_tensor, []

    def copy_then_interrupt(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 12:  # well into the second part
            raise KeyboardInterrupt
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(split, "_copy_tensor", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        split_gguf(tiny_qwen2, tmp_path / "i", max_tensors=8, progress=False)
    assert list(tmp_path.iterdir()) == []
