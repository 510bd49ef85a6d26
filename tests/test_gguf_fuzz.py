"""Corrupt GGUF files: every mutation opens cleanly or raises exactly GGUFError / ModelError.

A small synthetic model is mutated well over a thousand ways (seeded): truncation inside every
header field and at region boundaries, every length/count/type/shape/offset field overwritten
with huge, negative (two's complement), zero and off-by-one values, and random byte flips.
A lying header must never allocate hugely or hang, so each case is also timed.
"""

from __future__ import annotations

import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType

from minfer.errors import GGUFError, ModelError
from minfer.gguf import GGUFFile
from minfer.gguf.hparams import HParams
from minfer.gguf.parse import Cursor
from minfer.tools.synth import build_tiny_vocab, write_tiny_model

U64_VALUES = (0, 1, 2, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63,
              (1 << 64) - 1, (1 << 64) - 8)
ELEMENT_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
U32_VALUES = (0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 255, 0x7FFFFFFF, 0xFFFFFFFF)


def _fields(data: bytes) -> tuple[list[tuple[int, int]], list[int], int]:
    """(offset, width) of every numeric header field, region boundaries, and the data start."""
    cur = Cursor(memoryview(data), "seed")
    fields: list[tuple[int, int]] = [(4, 4), (8, 8), (16, 8)]
    boundaries = [0, 4, 8, 16, 24]

    def u(width: int) -> int:
        fields.append((cur.pos, width))
        return cur.u32("") if width == 4 else cur.u64("")

    def string() -> None:
        length = u(8)
        cur.pos += length

    cur.pos = 8
    n_tensors = cur.u64("")
    n_kv = cur.u64("")
    for _ in range(n_kv):
        boundaries.append(cur.pos)
        string()
        vtype = u(4)
        if vtype == GGUFValueType.STRING:
            string()
        elif vtype == GGUFValueType.ARRAY:
            etype = u(4)
            count = u(8)
            if etype == GGUFValueType.STRING:
                for i in range(count):
                    if i < 3 or i == count - 1:
                        string()
                    else:
                        length = cur.u64("")
                        cur.pos += length
            else:
                cur.pos += count * ELEMENT_BYTES[etype]
        else:
            cur.value(vtype, "")
    for _ in range(n_tensors):
        boundaries.append(cur.pos)
        string()
        n_dims = u(4)
        for _ in range(n_dims):
            u(8)
        u(4)
        u(8)
    boundaries.append(cur.pos)
    data_start = -(-cur.pos // 32) * 32
    return fields, boundaries, data_start


@pytest.fixture(scope="module")
def seed_model(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    types = {"default": QType.Q8_0, "token_embd": QType.F16}
    vocab = build_tiny_vocab(n_merges=40)
    path = write_tiny_model(tmp_path_factory.mktemp("fuzz") / "seed.gguf", n_layer=1, n_embd=32,
                            n_head=2, n_head_kv=1, n_ff=64, vocab=vocab, weight_types=types)
    return path.read_bytes()


def _mutations(data: bytes, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    fields, boundaries, data_start = _fields(data)
    cases: list[tuple[str, bytes]] = []
    cuts = set(range(0, 40)) | {b + d for b in boundaries for d in (-1, 0, 1, 5)}
    cuts |= {data_start - 1, data_start, len(data) - 1, len(data) // 2}
    cuts |= {int(x) for x in rng.integers(0, len(data), 60)}
    cases += [(f"truncate@{n}", data[:n]) for n in sorted(cuts) if 0 <= n < len(data)]
    for off, width in fields:
        values = U32_VALUES if width == 4 else U64_VALUES
        old = int.from_bytes(data[off : off + width], "little")
        for v in {*values, old + 1, max(old - 1, 0)}:
            mutated = data[:off] + v.to_bytes(width, "little") + data[off + width :]
            cases.append((f"field@{off}={v}", mutated))
    for i in range(1500):
        buf = bytearray(data)
        limit = data_start + 64 if i % 4 else len(data)
        for pos in rng.integers(0, limit, int(rng.integers(1, 4))):
            buf[int(pos)] ^= int(rng.integers(1, 256))
        cases.append((f"flip#{i}", bytes(buf)))
    return cases


@pytest.mark.timeout(120)
def test_fuzz_open_and_hparams(seed_model: bytes, tmp_path: Path) -> None:
    HParams.from_gguf(GGUFFile.open(_put(tmp_path / "ok.gguf", seed_model)))
    cases = _mutations(seed_model, np.random.default_rng(1234))
    assert len(cases) >= 1000
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {"ok": 0, "GGUFError": 0, "ModelError": 0}
    path = tmp_path / "case.gguf"
    for name, blob in cases:
        _put(path, blob)
        t0 = time.perf_counter()
        try:
            HParams.from_gguf(GGUFFile.open(path))
            outcomes["ok"] += 1
        except (GGUFError, ModelError) as exc:
            outcomes[type(exc).__name__] += 1
            assert str(path) in str(exc) or isinstance(exc, ModelError), name
        except Exception as exc:  # pragma: no cover - the failure being tested for
            pytest.fail(f"{name}: {type(exc).__name__}: {exc}")
        assert time.perf_counter() - t0 < 1.0, f"{name} took too long"
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 200, f"peak RSS grew by {grown_mb:.0f} MB"
    assert outcomes["GGUFError"] > len(cases) // 2, outcomes


def _put(path: Path, blob: bytes) -> Path:
    path.write_bytes(blob)
    return path


@pytest.mark.timeout(60)
def test_info_on_corrupt_files_is_one_line(seed_model: bytes, tmp_path: Path) -> None:
    count_at = 16  # the metadata count, set absurdly high
    lying = seed_model[:count_at] + struct.pack("<Q", 1 << 60) + seed_model[count_at + 8 :]
    for name, blob in [("truncated", seed_model[:3000]), ("lying", lying)]:
        path = _put(tmp_path / f"{name}.gguf", blob)
        proc = subprocess.run([sys.executable, "-m", "minfer.cli.main", "info", str(path)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith("minfer: error: ") and str(path) in lines[0]
