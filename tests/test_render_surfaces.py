"""One conversation with tool calls renders to the same bytes on every surface.

The Python API (`Model.render_chat`), `minfer tokenize --chat`, the server's `/apply-template`
and its chat routes all render through `sampling.tool_calls.history_for`: an assistant call's
`arguments` (JSON text in the API) reach the template as an object, as llama-server passes them,
so a Qwen-style template's `arguments | tojson` writes `{"city": "Paris"}`, never the quoted text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from minfer.cli.main import main
from tests.fake_engine import HashEngine
from tests.test_server_app import CHAT, call, make_state

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "array"}}}}}


@pytest.mark.parametrize("kind", ["qwen3", "plain"])
def test_a_tool_call_renders_alike_through_api_cli_and_server(
        kind: str, tmp_path: Path, think_model: Callable[..., Path],
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import minfer
    from minfer.tools.synth import write_tiny_model

    path = think_model("qwen3") if kind == "qwen3" else write_tiny_model(tmp_path / "p.gguf")
    body = {"messages": CONVERSATION, "tools": [WEATHER]}
    model = minfer.load(path)
    api = model.render_chat(CONVERSATION, tools=[WEATHER])
    assert '{"city": "Paris", "days": [1, 2]}' in api and '\\"city\\"' not in api

    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(body))
    monkeypatch.setattr("minfer.cli.main.COMMANDS", ("tokenize",))
    assert main(["tokenize", str(path), "--chat", str(chat_file), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["text"] == api

    st = make_state(path, n_ctx=2048, slots=1)
    st.start()
    try:
        assert st.wait_ready(30)
        served = call(st, "POST", "/apply-template", json=body).json()["prompt"]
        assert served == api
        worker = st.model().worker
        assert worker is not None and worker.core.runner is not None
        engine = worker.core.runner.engine
        assert isinstance(engine, HashEngine)
        before = len(engine.calls)
        r = call(st, "POST", CHAT, json={**body, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(cli["ids"])
        ran = [t for b in engine.calls[before:] for t in b.tokens.tolist()]
        assert ran == cli["ids"]  # the prompt the chat route prefilled
    finally:
        st.stop()
