"""minfer viz: node statistics, the per-step trace, the JSON endpoints and MINFER_TRACE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from minfer.api import Model
from minfer.engine.tensor_stats import HEAT_COLS, HEAT_ROWS, summarize, summarize_reference
from minfer.errors import MinferError
from minfer.viz.app import create_app
from minfer.viz.session import VizSession, load_trace


@pytest.fixture(scope="module")
def session(tiny_qwen2: Path) -> VizSession:
    return VizSession(model=Model(tiny_qwen2, n_ctx=128, backend="cpu"))


@pytest.fixture(scope="module")
def client(session: VizSession) -> TestClient:
    return TestClient(create_app(session))


def _events(client: TestClient, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    events = []
    with client.stream("POST", "/api/generate", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def _pooled_reference(x: np.ndarray) -> np.ndarray:
    """The heatmap by plain loops: each cell the signed value of largest |x| in its block."""
    x2 = x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(1, -1)
    rb = -(-x2.shape[0] // HEAT_ROWS)
    cb = -(-x2.shape[1] // HEAT_COLS)
    out = np.zeros((-(-x2.shape[0] // rb), -(-x2.shape[1] // cb)))
    for r in range(out.shape[0]):
        for c in range(out.shape[1]):
            block = x2[r * rb:(r + 1) * rb, c * cb:(c + 1) * cb].astype(np.float64).ravel()
            block = block[np.isfinite(block)]
            if block.size and np.abs(block).max() > 0:
                out[r, c] = block[np.argmax(np.abs(block))]
    return out


@pytest.mark.parametrize("shape", [(1, 64), (7, 896), (20, 33), (300,), (3, 2, 5)])
def test_summarize_matches_numpy(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    flat = x.reshape(-1)
    flat[::17] = np.nan
    flat[5] = np.inf
    flat[-1] = -np.inf
    stats, heat = summarize(x)
    want = summarize_reference(x)
    assert stats["nan"] == want["nan"] > 0 and stats["inf"] == want["inf"] == 2
    for key in ("min", "max", "mean", "std", "absmax"):
        assert stats[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    np.testing.assert_allclose(heat, _pooled_reference(x), rtol=1e-6)


def test_summarize_int_input_and_empty() -> None:
    stats, heat = summarize(np.arange(10, dtype=np.int32))
    assert (stats["min"], stats["max"], stats["mean"]) == (0.0, 9.0, 4.5)
    assert heat.shape == (1, 10)
    assert summarize(np.zeros((0, 4), np.float32))[0]["absmax"] == 0.0


def test_graph_endpoint_counts_equal_the_graph(client: TestClient, session: VizSession) -> None:
    engine = session.engine()
    for kind, n_tokens in (("prefill", 8), ("decode", 1)):
        body = client.get(f"/api/graph?kind={kind}").json()
        graph = engine.cache.get(engine.params_for(n_tokens, 1)).graph
        assert body["kind"] == kind and body["uid"] == graph.uid
        assert len(body["nodes"]) == len(graph.nodes)
        assert len(body["edges"]) == sum(len(n.srcs) for n in graph.nodes)
        assert body["edges"] == [[s, n.id] for n in graph.nodes for s in n.srcs]
        node = next(n for n in body["nodes"] if n["name"] == "attn_q" and n["layer"] == 0)
        assert node["op"] == "MatMul" and node["backend"] == "cpu"
        assert node["weights"][0] == {"name": "blk.0.attn_q.weight", "type": "Q8_0"}
        assert node["buffer"]["slot"] >= 0 and node["shape"] == [n_tokens, 64]
        # prefill: the SwiGLU the fusion pass wrote; decode: gate, up and SwiGLU as one node
        # (fuse_gate_up), written so by the builder
        fused_op = "SwiGLU" if kind == "prefill" else "FusedGateUp"
        fused = [n for n in body["nodes"] if n["op"] == fused_op]
        assert fused and all(n["fused"] for n in fused)
        if kind == "prefill":
            assert any(n["orphaned"] for n in body["nodes"])  # the Silu the fusion replaced
        tail = {n["name"] for n in body["nodes"] if n["tail"]}
        assert ("tail_resid" in tail and "output" in tail) == (kind == "prefill")
        assert not any(n["tail"] for n in body["nodes"] if n["layer"] == 0)


def test_generate_streams_steps_and_tokens_and_the_trace_matches_numpy(
        client: TestClient, session: VizSession) -> None:
    session.tracer.capture = True  # keep node outputs to recompute the statistics
    try:
        events = _events(client, {"prompt": "Hello world", "max_tokens": 4})
    finally:
        session.tracer.capture = False
    names = [name for name, _ in events]
    assert names.count("token") == 4 and names[-1] == "done"
    steps = [ev for name, ev in events if name == "step"]
    assert [s["kind"] for s in steps] == ["prefill", "decode", "decode", "decode"]
    assert all(len(s["top"]) == 5 and s["ops"]["MatMul"] > 0 for s in steps)
    assert sum(t["p"] for t in steps[0]["top"]) <= 1.0 + 1e-9
    decode = client.get("/api/trace/1").json()
    assert decode["kind"] == "decode" and decode["n_tokens"] == 1
    assert decode["tokens"] == [next(ev["id"] for n, ev in events if n == "token")]
    outputs = session.tracer.steps[1].outputs
    graph = client.get(f"/api/graph?uid={decode['graph']}").json()
    by_name = {(n["name"], n["layer"]): n["id"] for n in graph["nodes"]}
    records = {r["id"]: r for r in decode["nodes"]}
    for key in (("attn_q", 0), ("attn.1", 1), ("ffn_gate_up", 1), ("output", -1),
                ("token_ids", -1)):
        node_id = by_name[key]
        want = summarize_reference(outputs[node_id]) if key[0] != "token_ids" else \
            summarize_reference(np.asarray(decode["tokens"]))
        for stat, value in want.items():
            assert records[node_id]["stats"][stat] == pytest.approx(value, rel=1e-5, abs=1e-7)
    assert len(client.get("/api/steps").json()) == 4


def test_bad_input_gets_4xx(client: TestClient) -> None:
    assert client.get("/api/graph?kind=sideways").status_code == 400
    assert client.get("/api/graph?uid=99999").status_code == 404
    assert client.get("/api/trace/12345").status_code == 404
    assert client.get("/api/trace/abc").status_code == 422
    for body in ({"prompt": ""}, {"prompt": "hi", "max_tokens": 0}, {"max_tokens": 3},
                 {"prompt": "hi", "temperature": -1}):
        assert client.post("/api/generate", json=body).status_code == 422, body
    assert client.post("/api/diff", json={"prompt": "hi", "max_tokens": 1000}).status_code == 422
    resp = client.get("/api/graph?kind=sideways")
    assert "kind must be one of" in resp.json()["error"]


def test_page_and_assets_are_served_locally(client: TestClient) -> None:
    page = client.get("/").text
    assert "/static/cytoscape.min.js" in page and "http" not in page.replace("http-equiv", "")
    for asset in ("viz.js", "viz.css", "cytoscape.min.js", "cytoscape.LICENSE.txt"):
        assert client.get(f"/static/{asset}").status_code == 200, asset


def test_diff_mode_compares_cpu_and_torch_node_by_node(session: VizSession) -> None:
    pytest.importorskip("torch")
    result = session.diff("Hello world", max_tokens=2)
    assert result["backends"] == ["cpu", "torch"]
    first, second = result["steps"]
    assert (first["kind"], second["kind"]) == ("prefill", "decode")
    graph = session.graph(uid=None, kind="decode")
    assert len(second["max_abs"]) == len(graph["nodes"])
    ids = {n["name"]: n["id"] for n in graph["nodes"]}
    assert second["max_abs"][ids["token_ids"]] == 0.0
    assert second["max_abs"][ids["kv_store.0"]] is None  # writes the KV region, no buffer
    logits = second["max_abs"][ids["output"]]
    assert 0.0 < logits < 1.0  # bf16 matmuls in torch: close, not equal
    assert second["worst"]["value"] == max(v for v in second["max_abs"] if v is not None)


def test_minfer_trace_env_writes_a_trace_the_page_opens(tiny_qwen2: Path, tmp_path: Path
                                                        ) -> None:
    out = tmp_path / "trace.json"
    env = {**os.environ, "MINFER_TRACE": str(out), "MINFER_BACKEND": "cpu"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "minfer.cli.main", "run", str(tiny_qwen2),
                           "-n", "3", "--temp", "0", "-c", "64", "Hello"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    trace = load_trace(out)
    kinds = [s["kind"] for s in trace["steps"]]
    assert kinds[0] == "prefill" and kinds.count("decode") >= 1
    viewer = TestClient(create_app(VizSession(trace=trace)))
    assert viewer.get("/api/info").json()["live"] is False
    decode = viewer.get("/api/graph?kind=decode").json()
    assert decode["nodes"] and viewer.get("/api/trace/1").json()["kind"] == "decode"
    assert viewer.post("/api/generate", json={"prompt": "x"}).status_code == 400
    assert trace["meta"]["model"] == tiny_qwen2.stem
    bad = tmp_path / "bad.json"
    for text, message in (('{"version": 99}', "not a minfer trace"), ("{", "cannot read"),
                          ('{"version": 1, "graphs": {}, "steps": [{"step": 0}]}', "lacks")):
        bad.write_text(text)
        with pytest.raises(MinferError, match=message):
            load_trace(bad)
