"""Ollama's API through the official `ollama` client, in-process (ASGI) on the tiny model's
tokenizer and the fake engine.

list / show / ps / version; chat and generate, whole and streamed (NDJSON: the pieces join to the
whole reply, `done` only on the last line), each equal to the OpenAI endpoint's greedy text for
the same conversation; options mapped (num_predict, temperature, stop); `format` json and a
schema constrain the output; raw generate and `suffix` (fill in the middle); a tool call in the
history is accepted; `think` and the thinking field on a reasoning template; an unknown model is
a 404 and bad bodies are Ollama's `{"error"}` 400s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import ollama
import pytest

from minfer.server.app import create_app
from minfer.server.state import ServerState
from minfer.tools.synth import write_tiny_model
from tests.test_server_app import CHAT, COMP, call, make_state

T = TypeVar("T")
MSG = [{"role": "user", "content": "Say hello"}]
GREEDY = {"temperature": 0, "num_predict": 10}
TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
       "<|file_sep|>")


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    path = write_tiny_model(tmp_path_factory.mktemp("ollama") / "coder.gguf", extra_tokens=FIM)
    st = make_state(path, n_ctx=2048, slots=2)
    st.start()
    assert st.wait_ready(30)
    yield st
    st.stop()


def with_client(state: ServerState, fn: Callable[[ollama.AsyncClient], Awaitable[T]]) -> T:
    async def go() -> T:
        transport = httpx.ASGITransport(app=create_app(state, own_state=False))
        return await fn(ollama.AsyncClient(host="http://test", transport=transport))

    return asyncio.run(go())


def openai_chat(state: ServerState, **body: Any) -> dict[str, Any]:
    r = call(state, "POST", CHAT, json={"messages": MSG, "temperature": 0, "max_tokens": 10,
                                        **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def test_list_show_ps_version(state: ServerState) -> None:
    listed = with_client(state, lambda c: c.list())
    (m,) = listed.models
    assert m.model == "coder:latest" and m.details.format == "gguf"
    assert m.details.family == "qwen2" and m.size > 0
    shown = with_client(state, lambda c: c.show("coder"))
    assert shown.modelinfo["general.architecture"] == "qwen2"
    assert shown.details.quantization_level
    assert shown.capabilities == ["completion", "insert"]  # a template without tools or thinking
    assert shown.template and "<|im_start|>" in shown.template  # the chat template (jinja)
    assert shown.modelfile and shown.modelfile.startswith("FROM ")
    assert "coder.gguf" in shown.modelfile
    running = with_client(state, lambda c: c.ps())
    assert [r.model for r in running.models] == ["coder:latest"]
    r = call(state, "GET", "/api/version")
    assert r.status_code == 200 and r.json()["version"]
    assert call(state, "GET", "/").text == "minfer is running"
    for path in ("/", "/api/version", "/api/tags"):  # Ollama's HEADs (the CLI's heartbeat)
        head = call(state, "HEAD", path)
        assert head.status_code == 200 and head.content == b"", path


def test_chat_equals_the_openai_reply(state: ServerState) -> None:
    ref = openai_chat(state)
    whole = with_client(state, lambda c: c.chat("coder:latest", messages=MSG, options=GREEDY))
    assert whole.message.content == ref["message"]["content"]
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 10
    assert whole.prompt_eval_count == call(state, "POST", CHAT, json={
        "messages": MSG, "max_tokens": 1}).json()["usage"]["prompt_tokens"]

    async def stream(c: ollama.AsyncClient) -> list[Any]:
        return [part async for part in await c.chat("coder", messages=MSG, options=GREEDY,
                                                     stream=True)]

    parts = with_client(state, stream)
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done


@pytest.mark.parametrize("stream", [False, True])
def test_durations_are_the_engines_prompt_and_generation_times(state: ServerState,
                                                               stream: bool) -> None:
    """`eval_count / eval_duration` is the generation rate clients show (`--verbose`): the
    engine's decode time of the request, streamed or not (it was ~0 for a whole reply)."""
    async def go(c: ollama.AsyncClient) -> Any:
        got = await c.generate(model="coder", prompt="hi", options=GREEDY, stream=stream)
        if not stream:
            return got
        return [part async for part in got][-1]

    final = with_client(state, go)
    assert final.done and 0 < final.eval_count <= 10
    assert final.eval_duration > 0 and final.prompt_eval_duration > 0
    assert final.prompt_eval_duration + final.eval_duration <= final.total_duration


def test_generate_templated_raw_and_fill_in_the_middle(state: ServerState) -> None:
    ref = openai_chat(state)
    gen = with_client(state, lambda c: c.generate("coder", prompt="Say hello", options=GREEDY))
    assert gen.response == ref["message"]["content"]
    raw_ref = call(state, "POST", COMP, json={"prompt": "def f(", "max_tokens": 10,
                                              "temperature": 0}).json()["choices"][0]["text"]
    raw = with_client(state, lambda c: c.generate("coder", prompt="def f(", raw=True,
                                                  options=GREEDY))
    assert raw.response == raw_ref
    fim_ref = call(state, "POST", COMP, json={"prompt": "def f(", "suffix": "\nf()",
                                              "max_tokens": 10, "temperature": 0}).json()
    fim = with_client(state, lambda c: c.generate("coder", prompt="def f(", suffix="\nf()",
                                                  options=GREEDY))
    assert fim.response == fim_ref["choices"][0]["text"]
    assert fim.prompt_eval_count == fim_ref["usage"]["prompt_tokens"]


def test_options_stop_and_format(state: ServerState) -> None:
    text = openai_chat(state)["message"]["content"]
    stop = text[2:5]
    out = with_client(state, lambda c: c.chat("coder", messages=MSG,
                                              options={**GREEDY, "stop": [stop]}))
    assert out.message.content == text[:text.index(stop)] and out.done_reason == "stop"
    as_json = with_client(state, lambda c: c.chat("coder", messages=MSG, format="json",
                                                  options={"temperature": 0, "num_predict": 64}))
    assert as_json.message.content.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    typed = with_client(state, lambda c: c.chat("coder", messages=MSG, format=schema,
                                                options={"temperature": 0, "num_predict": 64}))
    assert set(json.loads(typed.message.content)) == {"ok"}


def test_tool_calls_have_object_arguments(state: ServerState) -> None:
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
        "additionalProperties": False}}}
    # the fake engine's random text is not a call; a forced one through OpenAI's tool_choice is
    # not in Ollama's API, so a round trip is checked: a call in the history is accepted
    history = [*MSG, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "pick", "arguments": {"n": 1}}}]},
        {"role": "tool", "content": "done", "tool_name": "pick"}]
    out = with_client(state, lambda c: c.chat("coder", messages=history, tools=[tool],
                                              options=GREEDY))
    assert out.done and isinstance(out.message.content, str)


def test_think_and_the_thinking_field(think_model: Callable[..., Path]) -> None:
    path = think_model("r1-distill-qwen")
    st = make_state(path, n_ctx=512, slots=1)
    st.start()
    try:
        assert st.wait_ready(30)
        ref = openai_chat(st, reasoning_budget=-1)["message"]
        out = with_client(st, lambda c: c.chat("r1-distill-qwen", messages=MSG, think=True,
                                                options=GREEDY))
        assert out.message.thinking == ref["reasoning_content"] and out.message.content == ""

        async def stream(c: ollama.AsyncClient) -> list[Any]:
            return [p async for p in await c.chat("r1-distill-qwen", messages=MSG, think=True,
                                                   options=GREEDY, stream=True)]

        parts = with_client(st, stream)
        assert "".join(p.message.thinking or "" for p in parts) == ref["reasoning_content"]
        shown = with_client(st, lambda c: c.show("r1-distill-qwen"))
        assert shown.capabilities == ["completion", "thinking"]
    finally:
        st.stop()


def test_capabilities_follow_the_chat_template(think_model: Callable[..., Path]) -> None:
    """Qwen3's template writes the tools and switches thinking: both are capabilities."""
    st = make_state(think_model("qwen3"), n_ctx=256, slots=1)
    st.start()
    try:
        assert st.wait_ready(30)
        shown = with_client(st, lambda c: c.show("qwen3"))
        assert shown.capabilities == ["completion", "tools", "thinking"]
    finally:
        st.stop()


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_thinking_asked_of_a_model_that_cannot_think_is_ollamas_400(state: ServerState,
                                                                     path: str) -> None:
    """As Ollama: a 400 naming the model (clients match "does not support thinking" and ask
    again without `think`); `think: false` is accepted."""
    body = {"model": "coder", "messages": MSG, "prompt": "hi", "options": GREEDY}
    for think in (True, "high"):
        r = call(state, "POST", path, json={**body, "think": think, "stream": False})
        assert r.status_code == 400 and r.json() == {"error": "coder does not support thinking"}
    r = call(state, "POST", path, json={**body, "think": False, "stream": False})
    assert r.status_code == 200 and r.json()["done"]
    with pytest.raises(ollama.ResponseError) as info:
        with_client(state, lambda c: c.chat("coder", messages=MSG, think=True))
    assert info.value.status_code == 400 and "does not support thinking" in info.value.error


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/api/chat", {"model": "nope", "messages": MSG}, 404),
    ("/api/chat", {"model": "coder", "messages": [{"role": "user", "content": "x",
                                                   "images": ["aGk="]}]}, 400),
    ("/api/chat", {"model": "coder", "messages": MSG, "options": {"temperature": "hot"}}, 400),
    ("/api/generate", {"model": "coder", "prompt": "x", "format": "yaml"}, 400),
    ("/api/generate", {"prompt": "x"}, 400),
    ("/api/embed", {"model": "coder", "input": "x"}, 400),
    ("/api/show", {"model": "nope"}, 404),
])
def test_errors_are_ollama_errors(state: ServerState, path: str, body: dict[str, Any],
                                  status: int) -> None:
    r = call(state, "POST", path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]


def test_an_empty_prompt_only_loads_and_keep_alive_0_unloads(state: ServerState) -> None:
    for path, body in (("/api/generate", {}), ("/api/chat", {"messages": []})):
        r = call(state, "POST", path, json={"model": "coder", **body})
        assert r.status_code == 200 and r.json()["done_reason"] == "load"
        r = call(state, "POST", path, json={"model": "coder", "keep_alive": 0, **body})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload"


def test_generate_context_continues_an_exchange(state: ServerState) -> None:
    """Ollama's `context`: the final object carries the exchange's ids (the templated prompt's,
    then the reply's text tokenized); sent back, they go before the next templated prompt."""
    first = with_client(state, lambda c: c.generate("coder", prompt="Say hello",
                                                    options=GREEDY))
    n_prompt = first.prompt_eval_count
    ids = list(first.context or [])
    reply = call(state, "POST", "/tokenize", json={"content": first.response}).json()["tokens"]
    assert len(ids) == n_prompt + len(reply) and ids[n_prompt:] == reply
    alone = with_client(state, lambda c: c.generate("coder", prompt="And again",
                                                    options=GREEDY))
    second = with_client(state, lambda c: c.generate("coder", prompt="And again",
                                                     context=ids, options=GREEDY))
    assert second.prompt_eval_count == len(ids) + alone.prompt_eval_count
    prompt = list(second.context or [])[:second.prompt_eval_count]
    assert prompt[:len(ids)] == ids
    raw = call(state, "POST", COMP, json={"prompt": prompt, "max_tokens": 10,
                                          "temperature": 0}).json()["choices"][0]["text"]
    assert second.response == raw
    lines = [json.loads(line) for line in call(
        state, "POST", "/api/generate", json={"model": "coder", "prompt": "And again",
                                              "context": ids, "options": GREEDY}
    ).text.splitlines()]
    assert lines[-1]["context"] == second.context and "context" not in lines[0]
    raw_gen = with_client(state, lambda c: c.generate("coder", prompt="def f(", raw=True,
                                                      options=GREEDY))
    assert raw_gen.context is None  # as Ollama: raw mode keeps no exchange


@pytest.mark.parametrize("extra", [{"context": [1, 2]}, {"system": "Be brief"}])
def test_raw_mode_refuses_context_and_system(state: ServerState, extra: dict[str, Any]) -> None:
    r = call(state, "POST", "/api/generate", json={"model": "coder", "prompt": "x", "raw": True,
                                                   "stream": False, **extra})
    assert r.status_code == 400
    assert r.json() == {"error": "raw mode does not support template, system, or context"}


def test_context_ids_outside_the_vocabulary_are_a_400(state: ServerState) -> None:
    r = call(state, "POST", "/api/generate", json={"model": "coder", "prompt": "x",
                                                   "context": [10**9], "stream": False})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]


def test_the_client_raises_on_an_unknown_model(state: ServerState) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        with_client(state, lambda c: c.chat("other", messages=MSG))
    assert info.value.status_code == 404


def test_building_and_publishing_models_is_refused_clearly(state: ServerState) -> None:
    """create / push / blobs: Ollama's error shape with a 501 saying why, through the client
    too (it was a bare 404 "Not Found")."""
    for method, path in (("POST", "/api/create"), ("POST", "/api/push"),
                         ("POST", "/api/blobs/sha256:00"), ("HEAD", "/api/blobs/sha256:00")):
        r = call(state, method, path, json={"model": "x"})
        assert r.status_code == 501
        if method == "POST":
            assert "not supported by minfer" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as info:
        with_client(state, lambda c: c.create(model="terse", from_="m", system="Be terse."))
    assert info.value.status_code == 501 and "/api/create" in str(info.value)


def test_pull_a_catalogue_model_already_cached_and_delete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: ServerState) -> None:
    """The catalogue's model already in the cache: pull reports success (no download) and the
    server serves it too; delete unloads it and removes the cache's file."""
    import shutil

    from minfer.store.catalog import load_catalog

    name = "gemma-3-270m"
    cached = Path.home() / ".cache" / "minfer" / f"{name}.gguf"
    if not cached.is_file():
        from minfer.store.download import pull

        pull(name, progress=False)
    monkeypatch.setenv("MINFER_HOME", str(tmp_path))
    shutil.copy(cached, tmp_path / cached.name)
    (tmp_path / f"{name}.gguf.sha256").write_text(load_catalog().entry(name).sha256 + "\n")
    r = call(state, "POST", "/api/pull", json={"model": f"{name}:latest"})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    assert f"{name}:latest" in [m["name"] for m in call(state, "GET", "/api/tags").json()[
        "models"]]
    r = call(state, "DELETE", "/api/delete", json={"model": name})
    assert r.status_code == 200 and not (tmp_path / f"{name}.gguf").exists()
    assert name not in [m["id"] for m in call(state, "GET", "/v1/models").json()["data"]]
    assert call(state, "DELETE", "/api/delete", json={"model": name}).status_code == 404
    r = call(state, "POST", "/api/pull", json={"model": "no-such-model", "stream": False})
    assert r.status_code == 404 and "catalogue" in r.json()["error"]
    r = call(state, "POST", "/api/pull", json={"model": "hf:", "stream": False})
    assert r.status_code == 400 and "hf:ORG/REPO" in r.json()["error"]  # a malformed Hub name
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub model that cannot be had from here
    r = call(state, "POST", "/api/pull", json={"model": "hf:no-org/no-repo", "stream": False})
    assert r.status_code == 404 and "no-org/no-repo" in r.json()["error"]
    r = call(state, "DELETE", "/api/delete", json={"model": "coder"})
    assert r.status_code == 400  # the model the server started with


def test_copy_serves_a_second_name_and_refuses_to_overwrite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`client.copy`: the copy is listed and answers as its source (the same file, linked into
    the model cache); an existing destination, an unknown source and a name that is no file
    name are refused in Ollama's shape; deleting the copy leaves the source's file."""
    monkeypatch.setenv("MINFER_HOME", str(tmp_path / "home"))
    src = write_tiny_model(tmp_path / "alpha.gguf", seed=4)
    st = make_state(src, n_ctx=256, slots=2)
    st.start()
    assert st.wait_ready(30)
    try:
        async def go(c: ollama.AsyncClient) -> dict[str, Any]:
            await c.copy("alpha:latest", "alpha-copy")
            tags = [m.model for m in (await c.list()).models]
            replies = [(await c.chat(model=m, messages=MSG, options={"temperature": 0,
                                                                      "num_predict": 8}))
                       .message.content for m in ("alpha", "alpha-copy")]
            errors = []
            for source, dest in (("alpha", "alpha-copy"), ("nope", "other"),
                                 ("alpha", "../escape")):
                with pytest.raises(ollama.ResponseError) as info:
                    await c.copy(source, dest)
                errors.append((info.value.status_code, info.value.error))
            await c.delete("alpha-copy")
            return {"tags": tags, "replies": replies, "errors": errors,
                    "after": [m.model for m in (await c.list()).models]}

        got = with_client(st, go)
    finally:
        st.stop()
    assert got["tags"] == ["alpha:latest", "alpha-copy:latest"]
    assert got["replies"][0] == got["replies"][1] and got["replies"][0]
    assert [status for status, _ in got["errors"]] == [400, 404, 400]
    assert "already exists" in got["errors"][0][1] and "not a model name" in got["errors"][2][1]
    assert got["after"] == ["alpha:latest"] and src.is_file()
    assert not (tmp_path / "home" / "alpha-copy.gguf").exists()


CHATML_GO = ("{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
             "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n{{ .Response }}")


def test_a_go_template_override_renders_the_prompt(state: ServerState) -> None:
    """Generate's `template` (Go's syntax, the fields and conditionals Ollama's older templates
    use) replaces the model's: the reply is the raw completion of the rendered text."""
    gen = with_client(state, lambda c: c.generate("coder", prompt="Say hello", system="Be brief",
                                                  template=CHATML_GO, options=GREEDY))
    text = ("<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nSay hello<|im_end|>\n"
            "<|im_start|>assistant\n")
    ref = call(state, "POST", COMP, json={"prompt": text, "max_tokens": 10, "temperature": 0})
    assert gen.response == ref.json()["choices"][0]["text"]
    assert gen.prompt_eval_count == ref.json()["usage"]["prompt_tokens"]
    r = call(state, "POST", "/api/generate", json={
        "model": "coder", "prompt": "x", "stream": False,
        "template": "{{ range .Messages }}{{ .Content }}{{ end }}"})
    assert r.status_code == 400 and "unsupported action {{range .Messages}}" in r.json()["error"]
    r = call(state, "POST", "/api/generate", json={"model": "coder", "prompt": "x", "raw": True,
                                                   "template": CHATML_GO, "stream": False})
    assert r.status_code == 400 and "raw mode does not support template" in r.json()["error"]


@pytest.mark.parametrize(("source", "values", "text"), [
    (CHATML_GO, {"Prompt": "hi"}, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    ("{{ if .Suffix }}<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>{{ else if .System }}S"
     "{{ else }}{{ .Prompt }}{{ end }}", {"Prompt": "a", "Suffix": "b"}, "<PRE> a <SUF>b <MID>"),
    ("{{ if .Suffix }}x{{ else if .System }}S{{ else }}{{ $.Prompt }}{{ end }}", {"Prompt": "a"},
     "a"),
    ("A  {{- /* a comment */ -}}  B {{ .Prompt }}", {"Prompt": "p"}, "AB p"),
])
def test_the_go_template_subset(source: str, values: dict[str, str], text: str) -> None:
    from minfer.server.ollama.gotemplate import render

    assert render(source, values) == text


@pytest.mark.parametrize("source", ["{{ if .System }}x", "{{ end }}", "{{ .Tools }}",
                                    "{{ .Prompt | json }}", "{{ .Prompt", "{{ with .System }}"])
def test_what_the_subset_cannot_render_is_refused(source: str) -> None:
    from minfer.server.ollama.gotemplate import TemplateUnsupported, render

    with pytest.raises(TemplateUnsupported):
        render(source, {"Prompt": "p"})


def test_logprobs_are_the_openai_replys(state: ServerState) -> None:
    """`logprobs` / `top_logprobs`: each token's text, logprob and bytes with its alternatives,
    the OpenAI endpoint's values for the same request; streamed, the lines' lists join to the
    whole reply's."""
    body = {"model": "coder", "messages": MSG, "options": GREEDY, "logprobs": True,
            "top_logprobs": 2}
    whole = call(state, "POST", "/api/chat", json={**body, "stream": False}).json()
    ref = openai_chat(state, logprobs=True, top_logprobs=2)["logprobs"]["content"]
    assert [(lp["token"], lp["logprob"], lp["bytes"]) for lp in whole["logprobs"]] == [
        (r["token"], r["logprob"], r["bytes"]) for r in ref]
    assert [[t["logprob"] for t in lp["top_logprobs"]] for lp in whole["logprobs"]] == [
        [t["logprob"] for t in r["top_logprobs"]] for r in ref]
    lines = [json.loads(x) for x in call(state, "POST", "/api/chat", json=body).text.splitlines()]
    assert [lp for line in lines for lp in line.get("logprobs", [])] == whole["logprobs"]
    typed = with_client(state, lambda c: c.chat("coder", messages=MSG, options=GREEDY,
                                                logprobs=True, top_logprobs=2))
    assert [lp.logprob for lp in typed.logprobs or []] == [r["logprob"] for r in ref]
    raw = call(state, "POST", "/api/generate", json={
        "model": "coder", "prompt": "def f(", "raw": True, "stream": False, "options": GREEDY,
        "logprobs": True}).json()
    raw_ref = call(state, "POST", COMP, json={"prompt": "def f(", "max_tokens": 10,
                                              "temperature": 0, "logprobs": 0}).json()
    assert [lp["logprob"] for lp in raw["logprobs"]] == \
        raw_ref["choices"][0]["logprobs"]["token_logprobs"]
    assert "logprobs" not in call(state, "POST", "/api/chat", json={
        "model": "coder", "messages": MSG, "options": GREEDY, "stream": False}).json()
    bad = call(state, "POST", "/api/chat", json={**body, "top_logprobs": 21})
    assert bad.status_code == 400 and "top_logprobs" in bad.json()["error"]


def test_a_chat_too_long_for_the_context_keeps_its_latest_messages(state: ServerState) -> None:
    """As Ollama: the latest messages that fit (with the system message before them, the last
    message always), leaving the reply its num_predict (at most a quarter of the context); the
    OpenAI endpoint, as llama.cpp's, refuses the whole conversation."""
    n_ctx = state.model().limits.n_ctx_slot
    words = " ".join(f"w{i}" for i in range(n_ctx // 8))
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"{i} {words}"},
                 {"role": "assistant", "content": f"ok {i}"}]
    msgs.append({"role": "user", "content": "Say hello"})
    assert call(state, "POST", CHAT, json={"messages": msgs, "max_tokens": 4}).status_code == 400
    got = call(state, "POST", "/api/chat", json={"model": "coder", "messages": msgs,
                                                 "stream": False, "options": GREEDY}).json()
    room = GREEDY["num_predict"]
    assert got["prompt_eval_count"] + room <= n_ctx
    tails = {}
    for k in range(1, len(msgs)):
        r = call(state, "POST", CHAT, json={"messages": [msgs[0], *msgs[k:]], "max_tokens": 10,
                                            "temperature": 0})
        if r.status_code == 200:
            tails[k] = r.json()
    k = min(k for k, r in tails.items() if r["usage"]["prompt_tokens"] + room <= n_ctx)
    assert 1 < k < len(msgs) - 1  # some history dropped, some kept
    assert got["prompt_eval_count"] == tails[k]["usage"]["prompt_tokens"]
    assert got["message"]["content"] == tails[k]["choices"][0]["message"]["content"]
