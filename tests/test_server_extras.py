"""llama-server's `/props` and `/apply-template`, and CORS (`--cors-origin`, off by default)."""

from __future__ import annotations

from pathlib import Path

from minfer.server.state import ServerState
from tests.test_server_app import CHAT, call, make_state, state  # noqa: F401 (fixture)

MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_props(state: ServerState) -> None:  # noqa: F811
    body = call(state, "GET", "/props").json()
    assert body["total_slots"] == 2 and body["default_generation_settings"]["n_ctx"] == 256
    assert "im_start" in body["chat_template"] and body["modalities"]["vision"] is False


def test_apply_template_is_the_prompt_chat_completions_renders(state: ServerState) -> None:  # noqa: F811
    prompt = call(state, "POST", "/apply-template", json={"messages": MSG}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    n = len(call(state, "POST", "/tokenize", json={"content": prompt}).json()["tokens"])
    used = call(state, "POST", CHAT, json={"messages": MSG, "max_tokens": 1}).json()
    assert used["usage"]["prompt_tokens"] == n
    bad = call(state, "POST", "/apply-template", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_cors_only_when_asked(tiny_qwen2: Path, state: ServerState) -> None:  # noqa: F811
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    r = call(state, "OPTIONS", CHAT, headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    st = make_state(tiny_qwen2, cors_origins=("http://localhost:3000",), api_key="k")
    st.start()
    try:
        assert st.wait_ready(30)
        r = call(st, "OPTIONS", CHAT, headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = call(st, "GET", "/v1/models", headers={"Origin": "http://localhost:3000",
                                                   "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        st.stop()
