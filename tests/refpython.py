"""A Python interpreter that has llama-cpp-python, for tests that check files against llama.cpp.

The test interpreter itself when `llama_cpp` imports there, else `$MINFER_REF_PYTHON` (e.g. a
separate venv holding the reference build); tests skip with the reason when neither has it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def llama_python() -> str:
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    ref = os.environ.get("MINFER_REF_PYTHON")
    if ref and subprocess.run([ref, "-c", "import llama_cpp"], capture_output=True,
                              check=False).returncode == 0:
        return ref
    pytest.skip("llama-cpp-python is not importable here and $MINFER_REF_PYTHON names no "
                "interpreter that has it")


def run_json(python: str, script: str, *args: str) -> object:
    """Run script with python (args as sys.argv[1:]); it prints one JSON value last."""
    proc = subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                          check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
