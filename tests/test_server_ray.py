"""`minfer serve --ray` on a real local Ray cluster: two replicas, one killed mid-run.

The scenario (tests/ray_scenario.py) runs as its own process, inside a loopback-only network
namespace where `unshare -n` works, with Ray's usage statistics off, the node address pinned to
127.0.0.1 and a private RAY_TMPDIR; it tears down every process it started, by pid. This test
asserts on the outcomes it reports: 16 concurrent `openai` clients; every request completed or
failed with a retryable status, none hung; the killed replica was replaced and served again;
sessions stuck to their replica; chains of stored responses continued on the replica keeping
them; /metrics summed both replicas.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from minfer.server.ray.sandbox import can_unshare, isolated

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
    pytest.skip("Ray Serve is not installed (pip install 'minfer[ray]')",
                allow_module_level=True)
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
SCENARIO_TIMEOUT_S = 600
RETRYABLE = {429, 503}


def run_scenario(model: Path, out: Path) -> dict[str, Any]:
    proc = subprocess.Popen(isolated(["tests.ray_scenario", str(model), str(out)]), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the scenario tears its cluster down on SIGTERM
        log, _ = proc.communicate(timeout=60)
        pytest.fail(f"the Ray scenario hung: {log[-3000:]}")
    assert out.exists(), log[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert proc.returncode == 0 and "error" not in report, (report.get("error"), log[-3000:])
    return report


def check_outcome(r: dict[str, Any]) -> str:
    """ok, or the retryable failure a client saw; anything else fails the test."""
    if r["outcome"] == "ok":
        assert r["replica"] and r["text"], r
        return "ok"
    if r["outcome"] == "status":
        assert r["status"] in RETRYABLE, r
        return str(r["status"])
    assert r["outcome"] == "stream_error" and r["type"] == "server_unavailable", r
    return "stream_error"


@pytest.mark.slow
def test_replicas_survive_a_killed_replica(tiny_qwen2: Path, tmp_path: Path) -> None:
    report = run_scenario(tiny_qwen2, tmp_path / "ray.json")
    if can_unshare():
        assert report["interfaces"] == ["lo"]
    assert report["env"]["RAY_USAGE_STATS_ENABLED"] == "0"
    assert report["env"]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"

    before = report["replicas_before"]
    assert len(before) == 2 and len({r["node"] for r in before}) == 2  # one per node
    assert all(r["status"] == "ok" and r["threads"] == 1 for r in before)

    round1 = report["round1"]
    assert len(round1) == 16 * 4  # every request came back: none hung
    outcomes = Counter(check_outcome(r) for r in round1)
    assert outcomes["ok"] >= 16, outcomes

    killed = report["killed"]
    after = report["replicas_after"]
    assert len(after) == 2 and all(r["status"] == "ok" for r in after)
    assert killed["pid"] not in {r["pid"] for r in after}
    replacement = {r["replica"] for r in after} - {r["replica"] for r in before}
    assert len(replacement) == 1

    round2 = report["round2"]
    assert all(r["outcome"] == "ok" for r in round2), round2
    served_by: dict[str, set[str]] = {}
    for r in round2:
        served_by.setdefault(r["user"], set()).add(r["replica"])
    assert all(len(s) == 1 for s in served_by.values()), served_by  # sessions stick
    used = set().union(*served_by.values())
    assert used == {r["replica"] for r in after}  # ... and spread over both replicas
    assert replacement <= used  # the replacement serves

    # a stored response is continued on the replica that keeps it (the front routes a chain)
    assert report["chains"] == [[200] * 4] * 4, report["chains"]

    metrics = report["metrics"].splitlines()
    assert "minfer_replicas 2" in metrics
    assert "minfer_slots_total 32.0" in metrics  # 16 slots on each replica, summed
    assert report["health"] == {"status": "ok", "replicas": 2, "replicas_ok": 2}
