"""Ray Serve replicas vs the plain server: throughput, p50/p99 latency, Ray's per-request cost.

Not part of the test suite. Runs itself inside a loopback-only network namespace where
`unshare -n` works (see minfer.server.ray.sandbox), with Ray's usage statistics off and a
private RAY_TMPDIR. On one local Ray node with this machine's cores it measures, in one run:

- `plain -t1`, `plain -t2`: `minfer serve` (one engine, 1 or 2 threads);
- `ray 1x1`, `ray 2x1`: `minfer serve --ray` with 1 and 2 replicas of 1 thread each;

each under the same load: `--clients` concurrent clients (each its own `user`), each sending
`--requests` non-streaming completions of `--max-tokens` tokens (distinct prompts, greedy).
Throughput = requests (and generated tokens) per wall second; latency = per request; "lone" =
median latency of a lone client's 1-token request. `--overhead` measures Ray's per-request cost
instead: the lone client only, plain -t1 against ray 1x1, on a tiny synthetic model (a forward
takes about a millisecond there, so the difference is Ray's hops). Setups alternate round by
round (`--rounds`); the table shows medians. Ratios within one run are what count: the machine
may be shared.

    .venv/bin/python benchmarks/ray_scale.py [--model PATH] [--clients 8] [--requests 4]
    .venv/bin/python benchmarks/ray_scale.py --overhead
    .venv/bin/python benchmarks/ray_scale.py --memory
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from minfer.server.ray.sandbox import LocalCluster, apply_ray_env, can_unshare, isolated

HOST = "127.0.0.1"


@dataclass
class Row:
    setup: str
    req_s: float
    tok_s: float
    p50_s: float
    p99_s: float
    lone_p50_s: float  # a lone client's 1-token request
    errors: int
    rss_mib: list[int] | None = None  # each Ray replica's resident memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_health(base: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} not healthy")


async def one(client: httpx.AsyncClient, base: str, prompt: str, user: str,
              max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "user": user},
        timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, int(r.json()["usage"]["completion_tokens"])


async def load(base: str, clients: int, requests: int, max_tokens: int
               ) -> tuple[float, float, list[float], int]:
    lat: list[float] = []
    tokens = 0
    errors = 0

    async def worker(c: int, client: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        for i in range(requests):
            prompt = f"Client {c} request {i}: explain topic number {c * 31 + i} briefly."
            try:
                s, n = await one(client, base, prompt, f"client{c}", max_tokens)
            except httpx.HTTPError:
                errors += 1
                continue
            lat.append(s)
            tokens += n

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 2)) as client:
        await one(client, base, "warm up", "warm", 2)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c, client) for c in range(clients)))
        wall = time.perf_counter() - t0
    return wall, tokens, lat, errors


async def lone(base: str, n: int = 12) -> float:
    async with httpx.AsyncClient() as client:
        times = [(await one(client, base, f"Say {i}.", "lone", 1))[0] for i in range(n + 2)]
    return statistics.median(times[2:])


def measure(setup: str, base: str, args: argparse.Namespace) -> Row:
    if args.overhead:
        row = Row(setup, 0.0, 0.0, 0.0, 0.0, asyncio.run(lone(base, 60)), 0)
        print(json.dumps(asdict(row)), file=sys.stderr, flush=True)
        return row
    wall, tokens, lat, errors = asyncio.run(load(base, args.clients, args.requests,
                                                 args.max_tokens))
    lat.sort()
    row = Row(setup, len(lat) / wall, tokens / wall, lat[len(lat) // 2],
              lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], asyncio.run(lone(base)),
              errors)
    print(json.dumps(asdict(row)), file=sys.stderr, flush=True)
    return row


@contextlib.contextmanager
def plain(model: str, threads: int, args: argparse.Namespace) -> Iterator[str]:
    """A `minfer serve` process; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "minfer.cli.main", "serve", model, "--host", HOST, "--port",
           str(port), "-t", str(threads), "--slots", str(args.slots), "-c", str(args.n_ctx)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_health(f"http://{HOST}:{port}")
        yield f"http://{HOST}:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def deploy(config: Any, n: int, base: str) -> None:
    """The app with n replicas (a change of n scales the running deployment)."""
    from ray import serve

    from minfer.server.ray.deploy import RayOptions, build_app

    serve.run(build_app(config, RayOptions(replicas=n, threads=1)), name="minfer",
              route_prefix="/")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            infos = httpx.get(base + "/replicas", timeout=30).json()["replicas"]
        except httpx.HTTPError:
            infos = []
        if len(infos) == n and all(i["status"] == "ok" for i in infos):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas not ready")


def rounds(model: str, args: argparse.Namespace) -> dict[str, list[Row]]:
    """Every setup once per round, the rounds one after another (drift hits all setups)."""
    from ray import serve

    from minfer.engine.config import EngineConfig
    from minfer.server.state import ServerConfig

    config = ServerConfig(model_path=Path(model),
                          engine=EngineConfig.build(n_ctx=args.n_ctx, threads=1),
                          slots=args.slots)
    rows: dict[str, list[Row]] = {}
    with contextlib.ExitStack() as stack:
        p1 = stack.enter_context(plain(model, 1, args))
        p2 = None if args.overhead else stack.enter_context(plain(model, 2, args))
        stack.enter_context(LocalCluster(workers=0, cpus_per_node=os.cpu_count() or 2))
        base = f"http://{HOST}:{free_port()}"
        serve.start(http_options={"host": HOST, "port": int(base.rsplit(":", 1)[1])})
        stack.callback(serve.shutdown)
        for _ in range(args.rounds):
            rows.setdefault("plain -t1", []).append(measure("plain -t1", p1, args))
            if p2 is not None:
                rows.setdefault("plain -t2", []).append(measure("plain -t2", p2, args))
            for n in ((1,) if args.overhead else (2, 1)):
                deploy(config, n, base)
                row = measure(f"ray {n}x1", base, args)
                row.rss_mib = replica_rss_mib(base)
                rows.setdefault(f"ray {n}x1", []).append(row)
    return rows


def replica_rss_mib(base: str) -> list[int]:
    import psutil

    infos = httpx.get(base + "/replicas", timeout=30).json()["replicas"]
    return [psutil.Process(i["pid"]).memory_info().rss >> 20 for i in infos]


def memory(model: str, args: argparse.Namespace) -> None:
    """Two replicas' resident and proportional (shared pages split) memory, after a request
    each, with the repacked weights private and shared."""
    import psutil
    from ray import serve

    from minfer.engine import shared_weights
    from minfer.engine.config import EngineConfig
    from minfer.server.ray.deploy import RayOptions, build_app
    from minfer.server.state import ServerConfig

    config = ServerConfig(model_path=Path(model), engine=EngineConfig.build(n_ctx=args.n_ctx),
                          slots=args.slots)
    # the replicas (Ray workers inherit this) store the shared weights in the private tmpdir
    os.environ[shared_weights.ENV] = str(Path(os.environ["RAY_TMPDIR"]) / "derived")
    with LocalCluster(workers=0, cpus_per_node=os.cpu_count() or 2):
        base = f"http://{HOST}:{free_port()}"
        serve.start(http_options={"host": HOST, "port": int(base.rsplit(":", 1)[1])})
        for share in (False, True):
            opts = RayOptions(replicas=2, threads=1, share_weights=share)
            serve.run(build_app(config, opts), name="minfer", route_prefix="/")
            asyncio.run(load(base, 4, 1, 2))
            infos = httpx.get(base + "/replicas", timeout=30).json()["replicas"]
            mem = [psutil.Process(i["pid"]).memory_full_info() for i in infos]
            print(f"share_weights={share}: RSS MiB {[m.rss >> 20 for m in mem]}, "
                  f"PSS MiB {[m.pss >> 20 for m in mem]} (sum {sum(m.pss for m in mem) >> 20})")
        serve.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the development model)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="per client")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--overhead", action="store_true",
                   help="Ray's per-request cost on a tiny synthetic model (lone client only)")
    p.add_argument("--memory", action="store_true",
                   help="two replicas' memory with the repacked weights private, then shared")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.inside and can_unshare():
        argv = [os.path.abspath(__file__), *sys.argv[1:], "--inside"]
        os.execvp("unshare", isolated(argv))
    from minfer.store import resolve_model

    tmpdir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    apply_ray_env(tmpdir)
    if args.overhead:
        from minfer.tools.synth import write_tiny_model

        model = str(write_tiny_model(Path(tmpdir) / "tiny.gguf"))
    else:
        model = str(resolve_model(args.model))
    try:
        if args.memory:
            memory(model, args)
            return
        rows = rounds(model, args)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    report(rows, args)


def report(rows: dict[str, list[Row]], args: argparse.Namespace) -> None:
    def med(setup: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in rows[setup])

    load_desc = ("a lone client's 60 1-token requests" if args.overhead else
                 f"{args.clients} clients x {args.requests} requests x {args.max_tokens} tokens")
    print(f"medians of {args.rounds} rounds; {load_desc}")
    print("| setup | req/s | tok/s | p50 s | p99 s | lone 1-token p50 s | errors | RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for setup, rs in rows.items():
        print(f"| {setup} | {med(setup, 'req_s'):.2f} | {med(setup, 'tok_s'):.1f} "
              f"| {med(setup, 'p50_s'):.3f} | {med(setup, 'p99_s'):.3f} "
              f"| {med(setup, 'lone_p50_s'):.4f} | {sum(r.errors for r in rs)} "
              f"| {rs[-1].rss_mib or ''} |")
    overhead = med("ray 1x1", "lone_p50_s") - med("plain -t1", "lone_p50_s")
    print(f"\nlone 1-token p50, ray 1x1 - plain -t1: {overhead * 1000:.1f} ms"
          + (" (Ray's per-request cost)" if args.overhead else ""))
    if not args.overhead:
        for a, b in (("ray 1x1", "plain -t1"), ("ray 2x1", "plain -t2"),
                     ("ray 2x1", "ray 1x1")):
            print(f"throughput {a} / {b}: {med(a, 'req_s') / med(b, 'req_s'):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {k: [asdict(r) for r in v] for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
