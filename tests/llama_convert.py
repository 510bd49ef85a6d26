"""llama.cpp's convert_hf_to_gguf.py as a reference for `minfer convert`'s tests.

Found in `$MINFER_LLAMA_CPP_DIR` (a llama.cpp source tree), else in the test-data cache
(`~/.cache/minfer/test-data/llama-convert-<version>`), else fetched once with pip as the
llama-cpp-python sdist (which vendors llama.cpp) and only the converter's files kept.
Tests skip with the reason when none of that works (no package registry).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_RUNNER = """
import json, runpy, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "gguf-py")]
import conversion.base as base
detect = base.TextModel.get_vocab_base_pre
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
for model_dir, out, outtype, pre, *flags in json.loads(sys.argv[2]):
    # The tiny test tokenizers' hashes are unknown to llama.cpp: name their pre-tokenizer.
    base.TextModel.get_vocab_base_pre = (lambda self, tok, pre=pre: pre) if pre else detect
    sys.argv = [str(root / "convert_hf_to_gguf.py"), model_dir, "--outfile", out,
                "--outtype", outtype, *extra, *(flags[0] if flags else [])]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise
"""


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "minfer" / "test-data" / f"llama-convert-{VERSION}"


def _fetch(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}",
               "--no-deps", "--no-binary", ":all:", "--quiet", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip("llama.cpp's converter unavailable: pip download timed out")
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode or not sdists:
            pytest.skip(f"llama.cpp's converter unavailable: pip download failed "
                        f"({(proc.stderr or '').strip()[-200:]})")
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".fetch-"))
        try:
            with tarfile.open(sdists[0]) as tar:
                for m in tar.getmembers():
                    rel = m.name.removeprefix(prefix)
                    if m.name.startswith(prefix) and m.isfile() and rel.startswith(_KEEP):
                        m.name = rel
                        tar.extract(m, staging, filter="data")
            os.replace(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def llama_converter() -> Path:
    """A directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    if env := os.environ.get("MINFER_LLAMA_CPP_DIR"):
        return Path(env)
    dest = _cache_dir()
    if not (dest / "convert_hf_to_gguf.py").is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        _fetch(dest)
    return dest


def reference_convert(jobs: list[tuple[Path, Path, str, str | None]],
                      extra: tuple[str, ...] = (),
                      flags: dict[Path, tuple[str, ...]] | None = None) -> None:
    """Run llama.cpp's converter on each (model_dir, out, outtype, pre-tokenizer or None), all
    in one interpreter (this one's torch, transformers, sentencepiece): imports paid once.
    extra: more converter flags for every job (`--no-mtp`); flags: for the jobs of a model_dir
    only."""
    root = llama_converter()
    flags = flags or {}
    spec = json.dumps([[str(d), str(o), t, p, list(flags.get(d, ()))] for d, o, t, p in jobs])
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(root), spec, json.dumps(extra)],
                          capture_output=True,
                          text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
