"""`minfer imatrix` / `quantize --imatrix` against llama.cpp's own llama-imatrix / llama-quantize.

tests/fixtures/imatrix_llamacpp.json records the development model's comparison (the tools
built into /tmp/llbuild from llama-cpp-python 0.3.36's vendored llama.cpp); the live test
reruns llama-imatrix on the development model when that build exists and checks that minfer's
writers lay out llama-imatrix's statistics byte for byte in both formats.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from minfer.tools.quantize.imatrix_file import read, write_gguf, write_legacy

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "imatrix_llamacpp.json").read_text())
LLBUILD = Path("/tmp/llbuild/bin")
TEXT = Path(__file__).parent / "fixtures" / "kv_long_prompt.txt"


def test_recorded_comparison() -> None:
    assert FIXTURE["quantize_with_llama_imatrix"] == FIXTURE["minfer_quantize"]
    assert all(FIXTURE["imatrix_writers_byte_identical"].values())
    assert FIXTURE["imatrix_stats_vs_llama"]["counts_equal"]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.real_model
def test_live_writers_match_llama_imatrix(tmp_path: Path) -> None:
    src = Path.home() / ".cache" / "minfer" / "qwen2.5-coder-0.5b-instruct.gguf"
    if not (LLBUILD / "llama-imatrix").exists() or not src.exists():
        pytest.skip("no llama.cpp tools in /tmp/llbuild or no development model")
    for fmt in ("gguf", "dat"):
        subprocess.run([str(LLBUILD / "llama-imatrix"), "-m", str(src), "-f", str(TEXT),
                        "-o", str(tmp_path / f"ll.{fmt}"), "--output-format", fmt, "-c", "128",
                        "-b", "128", "-t", "2", "--no-ppl"], check=True, capture_output=True)
    im = read(tmp_path / "ll.gguf")
    write_gguf(tmp_path / "mf.gguf", im)
    write_legacy(tmp_path / "mf.dat", im)
    assert _sha(tmp_path / "mf.gguf") == _sha(tmp_path / "ll.gguf")
    assert _sha(tmp_path / "mf.dat") == _sha(tmp_path / "ll.dat")
