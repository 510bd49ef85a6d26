"""Property-based: schemathesis sends generated requests (valid and invalid) to the app.

In-process (ASGI) against a tiny synthetic model on the real engine, 2 slots of 64 tokens and
at most 4 generated tokens per request, so the run stays bounded. Every answer must be below 500,
arrive within the per-request timeout, and a 4xx must carry its API's error body (OpenAI's,
Anthropic's on /v1/messages, Ollama's on /api/); afterwards no slot is busy, nothing waits, the
engine thread is alive, and over 1,000 requests were made.

MINFER_FUZZ_ENGINE=fake runs the same test on the fake engine (no compiled kernels needed).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from minfer.engine.config import EngineConfig
from minfer.server.app import create_app
from minfer.server.state import ServerConfig, ServerState
from minfer.tools.synth import write_tiny_model

FAKE = os.environ.get("MINFER_FUZZ_ENGINE") == "fake"
if not FAKE:
    try:
        import minfer.engine.forward  # noqa: F401  (needs the compiled kernels)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"the engine cannot run here: {exc}", allow_module_level=True)

EXAMPLES_PER_OPERATION = 300
MIN_REQUESTS = 1000
REQUEST_TIMEOUT_S = 20


def _state() -> ServerState:
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="minfer-fuzz-")) / "tiny.gguf")
    config = ServerConfig(model_path=model, engine=EngineConfig.build(n_ctx=64, threads=1),
                          slots=2, queue=4, n_predict=4, max_body_bytes=256 << 10)
    factory = None
    if FAKE:
        from minfer.gguf.hparams import HParams
        from minfer.gguf.reader import GGUFFile
        from tests.fake_engine import HashEngine

        n_vocab = HParams.from_gguf(GGUFFile.open(model)).n_vocab
        factory = lambda n_ctx: HashEngine(n_ctx, n_vocab)  # noqa: E731
    return ServerState(config, engine_factory=factory)


STATE = _state()
STATE.start()  # the model loads while the schema is read and the tests collect
APP = create_app(STATE, own_state=False)  # schemathesis cycles the lifespan per test
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _loaded() -> None:
    assert STATE.wait_ready(120), STATE.error


@pytest.fixture(scope="module", autouse=True)
def _sandboxed_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """/api/pull and /api/delete act on the model cache: an empty one here, no Hub access."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINFER_HOME", str(tmp_path_factory.mktemp("home")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
def test_no_input_gets_a_5xx_or_hangs(case: schemathesis.Case) -> None:
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):  # Anthropic's error object
            assert body["type"] == "error", body
            assert set(body["error"]) == {"type", "message"}, body
        elif case.path.startswith("/api/"):  # Ollama's
            assert set(body) == {"error"} and isinstance(body["error"], str), body
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body


def test_after_the_storm_no_slot_leaked_and_enough_requests_were_sent() -> None:
    worker = STATE.model().worker
    assert worker.alive and worker.steps > 0
    assert worker.scheduler.n_busy == 0 and worker.scheduler.n_waiting == 0
    assert not worker.busy()
    total = STATE.metrics.requests.total()
    assert total >= MIN_REQUESTS, f"only {total:.0f} requests (run the whole module)"
