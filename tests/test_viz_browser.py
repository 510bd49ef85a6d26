"""The viz page in a real browser (headless Debian Chromium through selenium), cut off from
every outside host: `tests/viz_browser.py` runs `minfer viz` and Chromium together inside a
private loopback-only network namespace (`unshare -n`, where it works: root), with a dead
loopback proxy and no name resolution either way."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCRIPT = Path(__file__).with_name("viz_browser.py")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")


def _private_network() -> list[str]:
    """The command prefix that runs inside a new network namespace with only `lo` up, or []."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] \
        if probe.returncode == 0 else []


def test_page_draws_expands_shows_a_payload_and_streams_a_run(tiny_qwen2: Path,
                                                              tmp_path: Path) -> None:
    pytest.importorskip("selenium")
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["MINFER_BACKEND"] = "cpu"
    cmd = [*_private_network(), sys.executable, str(SCRIPT), str(tiny_qwen2), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "error" not in result, result
    assert result["console"] == []  # the page logged no errors
    page_warnings = [e for e in result["console_other"]
                     if e.get("source") == "console-api" and e.get("level") == "WARNING"]
    assert page_warnings == []
    assert result["expanded_count"] > result["collapsed_count"]  # layer 0 opened in place
    payload = result["payload"]
    for text in ("attn_q", "MatMul", "blk.0.attn_q.weight", "Q8_0", "slot", "reused by"):
        assert text in payload, (text, payload)
    assert len(result["tokens"]) == 6 and result["steps"] == 6
    assert result["top5_rows"] == 5 and result["op_rows"] >= 5
    assert "absmax" in result["stats"] and "NaN / Inf" in result["stats"]
    assert (tmp_path / "viz.png").stat().st_size > 10_000
    if importlib.util.find_spec("torch") is not None:  # the diff needs the torch backend
        assert "largest |Δ|" in result["diff_status"], result["diff_status"]
        assert result["diff_coloured"] > 10
