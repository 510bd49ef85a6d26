"""The lazy GGUF reader: metadata types, zero-copy tensor views, versions, alignment, split sets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from minfer.errors import GGUFError
from minfer.gguf import GGUFFile, StringArray


def _write(path: Path, *, alignment: int | None = None, split_max_tensors: int = 0) -> Path:
    w = gguf.GGUFWriter(path, "qwen2", split_max_tensors=split_max_tensors)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32("u32", 7)
    w.add_int64("i64", -5)
    w.add_float32("f32", 0.5)
    w.add_bool("flag", True)
    w.add_string("text", "héllo")
    w.add_array("strings", ["a", "bé", ""])
    w.add_array("ints", [1, 2, 3])
    w.add_array("floats", [0.25, 0.5])
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.ones((2, 32), dtype=np.float16))
    q = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), QType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=QType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_types(tmp_path: Path) -> None:
    f = GGUFFile.open(_write(tmp_path / "m.gguf"))
    m = f.metadata
    assert f.version == 3
    assert m["general.architecture"] == "qwen2"
    assert (m["u32"], m["i64"], m["f32"], m["flag"], m["text"]) == (7, -5, 0.5, True, "héllo")
    strings = m["strings"]
    assert isinstance(strings, StringArray)
    assert (len(strings), strings[1], strings[-1]) == (3, "bé", "")
    assert strings.tolist() == ["a", "bé", ""]
    assert strings.bytes_at(1) == "bé".encode()
    assert isinstance(m["ints"], np.ndarray) and m["ints"].tolist() == [1, 2, 3]
    assert m["floats"].dtype == np.float32


def test_tensor_views_are_zero_copy(tmp_path: Path) -> None:
    f = GGUFFile.open(_write(tmp_path / "m.gguf"))
    t = f.tensors["f32"]
    assert (t.shape, t.ggml_type, t.nbytes, t.part) == ((4, 3), QType.F32, 48, 0)
    a = f.array("f32")
    assert a.shape == (3, 4) and a.dtype == np.float32
    np.testing.assert_array_equal(a, np.arange(12).reshape(3, 4))
    assert not a.flags.owndata and not a.flags.writeable
    assert f.array("f16").dtype == np.float16
    raw = f.raw("q8")
    assert raw.shape == (2, 68) and raw.dtype == np.uint8
    deq = gguf.quants.dequantize(raw, QType.Q8_0)
    np.testing.assert_allclose(deq.ravel(), np.linspace(-1, 1, 128), atol=0.01)
    with pytest.raises(GGUFError, match="q8"):
        f.array("q8")
    with pytest.raises(GGUFError, match="nope"):
        f.raw("nope")
    assert f.file_size == os.path.getsize(f.path)
    assert f.tensors["f16"].offset % 32 == 0


def test_custom_alignment(tmp_path: Path) -> None:
    f = GGUFFile.open(_write(tmp_path / "m.gguf", alignment=256))
    assert all(t.offset % 256 == 0 for t in f.tensors.values())
    np.testing.assert_array_equal(f.array("f32").ravel(), np.arange(12))


def test_version_2_reads_and_others_refused(tmp_path: Path) -> None:
    data = bytearray(_write(tmp_path / "m.gguf").read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    (tmp_path / "v2.gguf").write_bytes(data)
    assert GGUFFile.open(tmp_path / "v2.gguf").version == 2
    for version in (1, 4, 0x03000000):
        data[4:8] = version.to_bytes(4, "little")
        (tmp_path / "bad.gguf").write_bytes(data)
        with pytest.raises(GGUFError, match="unsupported GGUF version"):
            GGUFFile.open(tmp_path / "bad.gguf")


def test_split_set_is_merged(tmp_path: Path) -> None:
    _write(tmp_path / "s.gguf", split_max_tensors=1)
    first = tmp_path / "s-00001-of-00003.gguf"
    f = GGUFFile.open(first)
    assert sorted(f.tensors) == ["f16", "f32", "q8"]
    assert sorted(t.part for t in f.tensors.values()) == [0, 1, 2]
    assert f.file_size == sum(p.stat().st_size for p in tmp_path.glob("s-*.gguf"))
    np.testing.assert_array_equal(f.array("f32").ravel(), np.arange(12))
    assert f.raw("q8").shape == (2, 68)
    with pytest.raises(GGUFError, match=r"open s-00001-of-00003\.gguf"):
        GGUFFile.open(tmp_path / "s-00002-of-00003.gguf")
    (tmp_path / "s-00003-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match=r"s-00003-of-00003\.gguf is missing"):
        GGUFFile.open(first)


def test_synthetic_models_open(tiny_qwen2: Path, tiny_qwen3: Path) -> None:
    f = GGUFFile.open(tiny_qwen3)
    assert f.architecture == "qwen3"
    assert f.tensors["blk.0.ffn_down.weight"].type_name == "Q6_K"
    assert f.raw("blk.0.ffn_down.weight").shape == (256, 512 // 256 * 210)
    assert GGUFFile.open(tiny_qwen2).array("token_embd.weight").dtype == np.float16


def test_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"missing\.gguf"):
        GGUFFile.open(tmp_path / "missing.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile.open(tmp_path / "empty.gguf")
    (tmp_path / "text.gguf").write_bytes(b"hello, this is not a model file at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile.open(tmp_path / "text.gguf")


@pytest.mark.real_model
def test_real_model_opens_fast_and_small(real_model_path: Path) -> None:
    """Opening the 0.5B model: < 0.5 s and < 100 MB RSS (measured in a fresh process)."""
    script = textwrap.dedent(f"""
        import time, psutil
        from minfer.gguf import GGUFFile
        proc = psutil.Process()
        rss0 = proc.memory_info().rss
        t0 = time.perf_counter()
        f = GGUFFile.open({str(real_model_path)!r})
        elapsed = time.perf_counter() - t0
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 151936
        print(elapsed, (proc.memory_info().rss - rss0) / 1e6)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    elapsed, rss_mb = map(float, out.split())
    assert elapsed < 0.5, f"open took {elapsed:.3f} s"
    assert rss_mb < 100, f"open added {rss_mb:.1f} MB RSS"


@pytest.mark.parametrize("strings", [
    [b"a", "b\xc3\xa9".encode("latin-1"), b""],
    [b"\xe2\x82", b"x\xff\xfey", b"\xf0\x9f\x98", b"ok", b"\xc3", b""],  # broken UTF-8
    [b"a\x00b", b"c"],  # a NUL inside: decoded one by one
    [], [b""], [b"", b""],
])
def test_string_array_tolist_decodes_each_element_as_alone(strings: list[bytes]) -> None:
    import struct

    buf = b"".join(struct.pack("<Q", len(s)) + s for s in strings)
    ends = np.cumsum([8 + len(s) for s in strings], dtype=np.int64)
    starts = np.concatenate([[8], ends[:-1] + 8]).astype(np.int64)[:len(strings)]
    got = StringArray(buf, starts, ends).tolist()
    assert got == [s.decode("utf-8", errors="replace") for s in strings]
    rng = np.random.default_rng(len(strings))
    many = [bytes(rng.integers(1, 256, rng.integers(0, 6)).tolist()) for _ in range(500)]
    buf = b"".join(struct.pack("<Q", len(s)) + s for s in many)
    ends = np.cumsum([8 + len(s) for s in many], dtype=np.int64)
    starts = np.concatenate([[8], ends[:-1] + 8]).astype(np.int64)
    assert StringArray(buf, starts, ends).tolist() == [s.decode("utf-8", errors="replace")
                                                       for s in many]


def _ends_one_by_one(buf: bytes, n: int) -> list[int] | None:
    pos, out = 0, []
    for _ in range(n):
        if pos + 8 > len(buf):
            return None
        pos += int.from_bytes(buf[pos:pos + 8], "little") + 8
        if pos > len(buf):
            return None
        out.append(pos)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_string_array_scan_reads_every_chain_as_one_by_one(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorised scan of a string array's length prefixes gives the offsets of a plain
    walk: for empty strings, strings over 255 bytes, bytes that look like prefixes (runs of
    NULs inside strings), arrays cut short (None, or an end past the buffer, which the cursor
    refuses), and windows smaller than the array (odd seeds)."""
    from minfer.gguf import parse
    from minfer.gguf.parse import _string_ends

    if seed % 2:
        monkeypatch.setattr(parse, "SCAN_MAX", 24 + seed)

    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 80))
    parts = []
    for _ in range(n):
        kind = int(rng.integers(0, 5))
        length = [0, int(rng.integers(1, 12)), int(rng.integers(250, 800)),
                  int(rng.integers(1, 40)), 7][kind]
        high = 2 if kind in (3, 4) else 256  # NULs and ones: prefix look-alikes inside
        parts.append(length.to_bytes(8, "little")
                     + bytes(rng.integers(0, high, length, dtype=np.uint8)))
    data = b"".join(parts) + bytes(rng.integers(0, 2, int(rng.integers(0, 30)), dtype=np.uint8))
    if seed % 4 == 3:
        data = data[:int(rng.integers(0, len(data) + 1))]
    want = _ends_one_by_one(data, n)
    got = _string_ends(memoryview(data), 0, n, len(data))
    if want is not None:
        assert got is not None and got.tolist() == want
    else:
        assert got is None or (n > 0 and int(got[-1]) > len(data))


def test_the_reading_paths_constants_are_gguf_pys() -> None:
    """minfer.gguf.constants (the reading path's, without importing gguf) holds gguf-py's
    names, values and block sizes, and every GGML type gguf-py knows."""
    from minfer.gguf import constants as c

    assert c.GGUF_DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT
    for mine, theirs in ((c.GGUFValueType, gguf.GGUFValueType),
                         (c.GGMLQuantizationType, gguf.GGMLQuantizationType)):
        assert {m.name: m.value for m in mine} == {m.name: m.value for m in theirs}
    assert {int(k): v for k, v in c.GGML_QUANT_SIZES.items()} == {
        int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}


def test_loading_a_model_does_not_import_gguf_py(tmp_path: Path) -> None:
    """Opening a GGUF, reading its hyper-parameters and building an engine leave the gguf
    package unimported (its import is most of a warm start's GGUF cost)."""
    from minfer.tools.synth import write_tiny_model

    path = write_tiny_model(tmp_path / "m.gguf")
    code = textwrap.dedent(f"""
        import sys
        from minfer.engine.forward import Engine
        from minfer.gguf.hparams import HParams
        from minfer.gguf.reader import GGUFFile
        f = GGUFFile.open({str(path)!r})
        Engine(f, HParams.from_gguf(f), n_ctx=16, n_threads=1)
        print("gguf" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "False"
