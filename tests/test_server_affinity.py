"""The pure parts of `minfer serve --ray`: session keys, replica ranking, thread planning,
summed /metrics, the CLI's flags; and that nothing imports Ray without `--ray`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from minfer.errors import MinferError
from minfer.server.metrics import Metrics, merge_expositions
from minfer.server.ray.affinity import chat_prefix, rank, session_key


def chat(messages: list[dict[str, str]], **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


SYSTEM = {"role": "system", "content": "You are terse."}


def test_user_field_is_the_key() -> None:
    a = session_key("/v1/chat/completions", chat([SYSTEM, {"role": "user", "content": "hi"}],
                                                  user="alice"))
    b = session_key("/v1/chat/completions", chat([{"role": "user", "content": "other"}],
                                                  user="alice"))
    assert a == b == "user:alice"


def test_chat_key_is_stable_across_turns_and_differs_between_chats() -> None:
    turn1 = [SYSTEM, {"role": "user", "content": "What is 2+2?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x2?"}]
    other = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    k1 = session_key("/v1/chat/completions", chat(turn1))
    assert k1 is not None and k1.startswith("chat:")
    assert session_key("/chat/completions", chat(turn2)) == k1
    assert session_key("/v1/chat/completions", chat(other)) != k1
    assert chat_prefix(turn2) == turn1


def test_completion_key_is_the_prompt_prefix() -> None:
    long = "x" * 5000
    k = session_key("/v1/completions", json.dumps({"prompt": long + "a"}).encode())
    assert k == session_key("/v1/completions", json.dumps({"prompt": long + "b"}).encode())
    assert k != session_key("/v1/completions", json.dumps({"prompt": "y" + long}).encode())
    assert session_key("/v1/completions", json.dumps({"prompt": [long]}).encode()) == k
    assert session_key("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode())


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/models", b""), ("/tokenize", b'{"content": "x"}'),
    ("/v1/chat/completions", b"not json"), ("/v1/chat/completions", b"[1, 2]"),
    ("/v1/chat/completions", b'{"messages": "nope"}'), ("/v1/completions", b'{"prompt": 3}'),
])
def test_no_key_routes_anywhere(path: str, body: bytes) -> None:
    assert session_key(path, body) is None


def test_rendezvous_ranking_moves_only_the_lost_replicas_keys() -> None:
    replicas = ["r1", "r2", "r3"]
    keys = [f"user:{i}" for i in range(600)]
    first = {k: rank(k, replicas)[0] for k in keys}
    assert all(sorted(rank(k, replicas)) == replicas for k in keys[:10])
    spread = Counter(first.values())
    assert len(spread) == 3 and min(spread.values()) > 120  # roughly even
    survivors = ["r1", "r3"]
    for k in keys:
        now = rank(k, survivors)[0]
        if first[k] != "r2":
            assert now == first[k]  # a key whose replica lives keeps it
        else:
            assert now == rank(k, replicas)[1]  # a lost replica's key goes to its next choice


def test_replica_threads_split_each_nodes_cores() -> None:
    from minfer.server.ray.deploy import replica_threads

    assert replica_threads([2], 1) == 2
    assert replica_threads([2], 2) == 1
    assert replica_threads([2], 3) == 1  # never 0
    assert replica_threads([16, 16], 2) == 16  # one replica per node
    assert replica_threads([16, 16], 4) == 8
    assert replica_threads([8, 16], 2) == 8  # the smallest node decides
    assert replica_threads([], 2) == 1


def test_parse_autoscale() -> None:
    from minfer.server.ray.deploy import parse_autoscale

    assert parse_autoscale("1:4") == (1, 4)
    for bad in ("4:1", "0:2", "2", "a:b", "1:"):
        with pytest.raises(MinferError, match="--autoscale"):
            parse_autoscale(bad)


def test_merged_metrics_sum_every_series() -> None:
    a, b = Metrics(), Metrics()
    a.requests.labels("/v1/completions", "200").inc(2)
    b.requests.labels("/v1/completions", "200").inc(3)
    b.requests.labels("/v1/completions", "503").inc()
    a.ttft.observe(0.02)
    b.ttft.observe(3.0)
    a.gauge("minfer_slots_total", "Slots", lambda: 4)
    b.gauge("minfer_slots_total", "Slots", lambda: 4)
    merged = merge_expositions([a.render(), b.render()])
    lines = merged.splitlines()
    assert 'minfer_requests_total{endpoint="/v1/completions",status="200"} 5.0' in lines
    assert 'minfer_requests_total{endpoint="/v1/completions",status="503"} 1.0' in lines
    assert "minfer_slots_total 8.0" in lines
    assert 'minfer_time_to_first_token_seconds_bucket{le="0.025"} 1.0' in lines
    assert 'minfer_time_to_first_token_seconds_bucket{le="+Inf"} 2.0' in lines
    assert "minfer_time_to_first_token_seconds_count 2.0" in lines
    assert lines.count("# TYPE minfer_requests_total counter") == 1
    assert merge_expositions([a.render()]) == a.render()
    assert merge_expositions([]) == ""


def test_ray_flags_need_ray_and_nothing_imports_ray_without_it() -> None:
    code = """
import sys
from minfer.cli.main import build_parser, main, parse
import minfer.server.app, minfer.server.state, minfer.cli.serve_cmd
args = parse(build_parser(), ["serve", "--replicas", "2", "/nonexistent.gguf"])
assert args.ray is False and args.replicas == 2
rc = main(["serve", "--replicas", "2", "--port", "1"])
assert rc == 2, rc
assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray"))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "need --ray" in done.stderr


def test_engine_options() -> None:
    from pathlib import Path

    from minfer.server.ray.deploy import RayOptions, engine_options
    from minfer.server.state import ServerConfig

    config = ServerConfig(model_path=Path("m.gguf"), slots=3, queue=7)
    fixed = engine_options(config, RayOptions(replicas=4, threads=2))
    assert fixed["num_replicas"] == 4 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2}  # Ray packs replicas by cores
    assert fixed["max_ongoing_requests"] == 3 and fixed["max_queued_requests"] == 7
    assert fixed["request_router_config"]["request_router_class"].endswith(".AffinityRouter")
    scaled = engine_options(config, RayOptions(autoscale=(1, 5)))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 5,
                                            "target_ongoing_requests": 3}


@pytest.mark.parametrize("opts", [{"replicas": 3, "threads": 2}, {"autoscale": (1, 4)}])
def test_build_app_accepts_the_options(tiny_qwen2: object, opts: dict[str, object]) -> None:
    """Ray Serve validates the deployments' options (autoscaling keys, router, resources)
    as they are built: building must not raise."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (minfer[ray])")
    from pathlib import Path

    from ray.serve import Application

    from minfer.server.ray.deploy import RayOptions, build_app
    from minfer.server.state import ServerConfig

    config = ServerConfig(model_path=Path(str(tiny_qwen2)), slots=2)
    assert isinstance(build_app(config, RayOptions(**opts)), Application)  # type: ignore[arg-type]


def test_a_responses_chain_is_keyed_by_the_id_it_continues() -> None:
    """Every response id carries its chain after `resp_`; a request continuing one is keyed by
    that chain (the replica that stored it), one starting a chain has no key (the front names
    one); a chain passed on is kept, an unusable one replaced."""
    from minfer.server.response_ids import chain_of, response_id

    rid = response_id("0123456789abcdef")
    assert rid.startswith("resp_0123456789abcdef") and chain_of(rid) == "0123456789abcdef"
    assert chain_of(response_id(None)) is not None and chain_of("resp_x") is None
    assert chain_of(response_id("not a chain")) != "not a chain"
    body = json.dumps({"input": "hi", "previous_response_id": rid}).encode()
    assert session_key("/v1/responses", body) == "chain:0123456789abcdef"
    assert session_key("/v1/responses", json.dumps({"input": "hi", "user": "u"}).encode()) is None
    assert session_key("/responses", json.dumps(
        {"input": "x", "previous_response_id": "resp_foreign"}).encode()) is None
