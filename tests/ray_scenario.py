"""The Ray Serve scenario behind tests/test_server_ray.py, run as its own process.

`python -m minfer.server.ray.sandbox tests.ray_scenario MODEL OUT.json` (inside a loopback-only
network namespace where possible; see ray_sandbox.isolated). Starts a local Ray cluster (a head
and a second worker node, one CPU each), deploys two engine replicas of MODEL, and drives
16 concurrent `openai` clients (each its own `user`, some streaming) through it; when the first
requests are done, one replica is killed (SIGKILL, by the pid the front reports). Replicas
have 16 slots, so 16 clients never fill one: every session stays on its replica (a full
replica's sessions would spill to their next choice). Then it waits
for the replacement, sends a second round, and reads /metrics and /replicas. Every request
outcome, the replica sets and the timings go to OUT.json for the test to assert on. Everything
it starts is torn down before it exits, even on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from minfer.server.ray.sandbox import LocalCluster, apply_ray_env, interfaces_up

CLIENTS = 16
REQUESTS_PER_CLIENT = 4
KILL_AFTER_DONE = 12
REQUEST_TIMEOUT_S = 90.0
RECOVERY_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_request(client: Any, user: str, i: int, stream: bool) -> dict[str, Any]:
    """One chat request; its outcome: ok (with the replica that served it) or the error."""
    import openai

    msgs = [{"role": "user", "content": f"{user} asks question {i}"}]
    t0 = time.monotonic()
    try:
        if stream:
            with client.chat.completions.with_streaming_response.create(
                    model="m", messages=msgs, max_tokens=8, temperature=0.0, user=user,
                    stream=True) as raw:
                replica = raw.headers.get("x-minfer-replica")
                pieces = [c.choices[0].delta.content or "" for c in raw.parse() if c.choices]
            out = {"outcome": "ok", "replica": replica, "text": "".join(pieces)}
        else:
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=msgs, max_tokens=8, temperature=0.0, user=user)
            text = raw.parse().choices[0].message.content
            out = {"outcome": "ok", "replica": raw.headers.get("x-minfer-replica"),
                   "text": text}
    except openai.APIStatusError as exc:
        out = {"outcome": "status", "status": exc.status_code, "body": str(exc.body)[:300]}
    except openai.APITimeoutError:
        out = {"outcome": "timeout"}
    except openai.APIError as exc:  # an error event inside a stream that had started
        body = exc.body if isinstance(exc.body, dict) else {}
        out = {"outcome": "stream_error", "code": body.get("code"), "type": body.get("type"),
               "message": str(exc)[:300]}
    except Exception as exc:  # reported, and the test fails on it
        out = {"outcome": "other", "error": f"{type(exc).__name__}: {exc}"[:300]}
    out.update(user=user, i=i, stream=stream, seconds=round(time.monotonic() - t0, 3),
               end=time.time())
    return out


def drive(base: str, done_hook: Any, per_client: int) -> list[dict[str, Any]]:
    import openai

    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        for i in range(per_client):
            r = one_request(client, f"client{c}", i, stream=(c % 4 == 0))
            with lock:
                results.append(r)
                n = len(results)
            done_hook(n)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def response_chains(base: str, n_chains: int = 4, length: int = 4) -> list[list[Any]]:
    """Stored responses continued through the front: each chain's outcomes, 200 or the status
    and error (each response is kept by the replica that made it; a continuation must reach
    that one). Short turns: a chain of 4 stays well inside the slots' 128-token context."""
    out = []
    for c in range(n_chains):
        outcomes: list[Any] = []
        previous = None
        for i in range(length):
            body: dict[str, Any] = {"input": f"{c}{i}", "max_output_tokens": 1,
                                    "temperature": 0}
            if previous is not None:
                body["previous_response_id"] = previous
            r = httpx.post(base + "/v1/responses", json=body, timeout=120)
            outcomes.append(200 if r.status_code == 200 else [r.status_code, r.text[:300]])
            previous = r.json().get("id") if r.status_code == 200 else previous
        out.append(outcomes)
    return out


def replicas(base: str) -> list[dict[str, Any]]:
    r = httpx.get(base + "/replicas", timeout=30)
    r.raise_for_status()
    return list(r.json()["replicas"])


def wait_replicas(base: str, n: int, exclude_pid: int | None, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            infos = replicas(base)
        except httpx.HTTPError:
            infos = []
        ok = [i for i in infos if i["status"] == "ok" and i["pid"] != exclude_pid]
        if len(ok) >= n:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas not back in {timeout} s: {infos}")


def scenario(model: Path, report: dict[str, Any]) -> None:
    from ray import serve

    from minfer.engine.config import EngineConfig
    from minfer.server.ray.deploy import RayOptions, build_app
    from minfer.server.state import ServerConfig

    t0 = time.monotonic()
    with LocalCluster(workers=1, cpus_per_node=1):
        report["cluster_ready_s"] = round(time.monotonic() - t0, 1)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServerConfig(model_path=model, engine=EngineConfig.build(n_ctx=128, threads=1),
                              slots=16, queue=64)
        serve.run(build_app(config, RayOptions(replicas=2, threads=1)), name="minfer",
                  route_prefix="/")
        report["deployed_s"] = round(time.monotonic() - t0, 1)
        before = replicas(base)
        report["replicas_before"] = before
        victim = before[0]
        killed = threading.Event()

        def kill_once(n_done: int) -> None:
            if n_done >= KILL_AFTER_DONE and not killed.is_set():
                killed.set()
                os.kill(victim["pid"], signal.SIGKILL)
                report["killed"] = {**victim, "after_done": n_done, "at": time.time()}

        report["round1_start"] = time.time()
        report["round1"] = drive(base, kill_once, REQUESTS_PER_CLIENT)
        report["recovery_s"] = round(wait_replicas(base, 2, victim["pid"],
                                                   RECOVERY_TIMEOUT_S), 1)
        report["replicas_after"] = replicas(base)
        report["round2"] = drive(base, lambda n: None, 2)
        report["chains"] = response_chains(base)
        report["metrics"] = httpx.get(base + "/metrics", timeout=30).text
        report["health"] = httpx.get(base + "/health", timeout=30).json()
        serve.shutdown()
    report["total_s"] = round(time.monotonic() - t0, 1)


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds: the cluster is torn down


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    tmpdir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live here
    apply_ray_env(tmpdir)
    report: dict[str, Any] = {"interfaces": interfaces_up(), "env": {
        k: os.environ[k] for k in ("RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                                   "RAY_TMPDIR")}}
    try:
        scenario(model, report)
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        out.write_text(json.dumps(report, indent=1))
        shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    main()
