"""Ray Serve replicas vs the plain server: throughput, p50/p99 latency, Ray's per-request cost.

Not part of the test suite. Runs itself inside a loopback-only network namespace where
`unshare -n` works (see minfer.server.ray_sandbox), with Ray's usage statistics off and a
private RAY_TMPDIR. On one local Ray node with this machine's cores it measures, in one run:

- `plain -t1`, `plain -t2`: `minfer serve` (one engine, 1 or 2 threads);
- `ray 1x1`, `ray 2x1`: `minfer serve --ray` with 1 and 2 replicas of 1 thread each;

each under the same load: `--clients` concurrent clients (each its own `user`), each sending
`--requests` non-streaming completions of `--max-tokens` tokens (distinct prompts, greedy).
Throughput = requests (and generated tokens) per wall second; latency = per request. Ray's
per-request overhead = median latency of a lone client's 1-token request, Ray minus plain
(same model, same thread). Ratios within one run are what count: the machine may be shared.

    .venv/bin/python benchmarks/ray_scale.py [--model PATH] [--clients 8] [--requests 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from minfer.server.ray_sandbox import LocalCluster, apply_ray_env, can_unshare, isolated

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
        times = [(await one(client, base, f"Say {i}.", "lone", 1))[0] for i in range(n)]
    return statistics.median(times[2:])


def measure(setup: str, base: str, args: argparse.Namespace) -> Row:
    wall, tokens, lat, errors = asyncio.run(load(base, args.clients, args.requests,
                                                 args.max_tokens))
    lat.sort()
    row = Row(setup, len(lat) / wall, tokens / wall, lat[len(lat) // 2],
              lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], asyncio.run(lone(base)),
              errors)
    print(json.dumps(asdict(row)), file=sys.stderr, flush=True)
    return row


def plain(model: str, threads: int, args: argparse.Namespace) -> Row:
    port = free_port()
    cmd = [sys.executable, "-m", "minfer.cli.main", "serve", model, "--host", HOST, "--port",
           str(port), "-t", str(threads), "--slots", str(args.slots), "-c", str(args.n_ctx)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_health(f"http://{HOST}:{port}")
        return measure(f"plain -t{threads}", f"http://{HOST}:{port}", args)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def on_ray(model: str, args: argparse.Namespace) -> list[Row]:
    from ray import serve

    from minfer.server.ray_deploy import RayOptions, build_app
    from minfer.server.state import ServerConfig

    config = ServerConfig(model_path=Path(model), n_ctx=args.n_ctx, slots=args.slots,
                          threads=1)
    rows = []
    with LocalCluster(workers=0, cpus_per_node=os.cpu_count() or 2):
        port = free_port()
        base = f"http://{HOST}:{port}"
        serve.start(http_options={"host": HOST, "port": port})
        for n in (2, 1):
            serve.run(build_app(config, RayOptions(replicas=n, threads=1)), name="minfer",
                      route_prefix="/")
            wait_health(base)
            rows.append(measure(f"ray {n}x1", base, args))
            if n == 2:
                rows[-1].setup += f" rss_mib={replica_rss_mib(base)}"
        serve.shutdown()
    return rows


def replica_rss_mib(base: str) -> list[int]:
    import psutil

    infos = httpx.get(base + "/replicas", timeout=30).json()["replicas"]
    return [psutil.Process(i["pid"]).memory_info().rss >> 20 for i in infos]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the development model)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="per client")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.inside and can_unshare():
        argv = [os.path.abspath(__file__), *sys.argv[1:], "--inside"]
        os.execvp("unshare", isolated(argv))
    from minfer.store import resolve_model

    model = str(resolve_model(args.model))
    tmpdir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    apply_ray_env(tmpdir)
    rows = [plain(model, 1, args), plain(model, 2, args), *on_ray(model, args),
            plain(model, 1, args)]
    rows[-1].setup += " (again)"
    print("| setup | req/s | tok/s | p50 s | p99 s | lone 1-token p50 s | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.setup} | {r.req_s:.2f} | {r.tok_s:.1f} | {r.p50_s:.3f} | {r.p99_s:.3f} "
              f"| {r.lone_p50_s:.4f} | {r.errors} |")
    base = statistics.mean([rows[0].lone_p50_s, rows[-1].lone_p50_s])
    ray1 = next(r for r in rows if r.setup.startswith("ray 1x1"))
    print(f"\nRay's per-request overhead (lone 1-token p50, ray 1x1 - plain -t1): "
          f"{(ray1.lone_p50_s - base) * 1000:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
