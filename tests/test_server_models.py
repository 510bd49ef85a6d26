"""Several models in one server: listed on every surface, loaded on first request, unloaded when
idle past keep_alive or beyond models_max, and never mixed up.

Fake engines over two tiny models whose chat templates differ (so the same conversation is a
different prompt, and a mix-up changes the text); then, slow, the development model beside
Gemma-3-270M in a real `minfer serve`: alternating clients get each model's solo greedy answer,
and an idle model's memory goes back when it unloads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from minfer.server.app import create_app
from minfer.server.state import ServerState
from minfer.tools.synth import write_tiny_model
from tests.test_server_app import CHAT, call, make_state

MSG = [{"role": "user", "content": "Say hello"}]
OTHER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role | upper }}: {{ m.content }}"
                  "<|im_end|>{% endfor %}<|im_start|>ASSISTANT:")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2: Path) -> list[Path]:
    folder = tmp_path_factory.mktemp("models")
    return [tiny_qwen2,
            write_tiny_model(folder / "beta.gguf", chat_template=OTHER_TEMPLATE, seed=1),
            write_tiny_model(folder / "gamma.gguf", chat_template="{{ messages[0].content }}",
                             seed=2)]


def serve(models: list[Path], **config: Any) -> ServerState:
    st = make_state(models[0], extra_models=tuple(models[1:]), n_ctx=256, slots=2, **config)
    st.start()
    assert st.wait_ready(30)
    return st


@pytest.fixture()
def state(models: list[Path]) -> Iterator[ServerState]:
    st = serve(models)
    yield st
    st.stop()


def chat(state: ServerState, model: str, **extra: Any) -> str:
    r = call(state, "POST", CHAT, json={"model": model, "messages": MSG, "max_tokens": 8,
                                        "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


def test_every_surface_lists_every_model(state: ServerState) -> None:
    ids = [m["id"] for m in call(state, "GET", "/v1/models").json()["data"]]
    assert ids == ["qwen2", "beta", "gamma"]
    tags = [m["name"] for m in call(state, "GET", "/api/tags").json()["models"]]
    assert tags == ["qwen2:latest", "beta:latest", "gamma:latest"]
    assert [m["name"] for m in call(state, "GET", "/api/ps").json()["models"]] == \
        ["qwen2:latest"]  # only the first model is loaded before any request


def test_concurrent_clients_on_two_models_get_their_solo_answers(state: ServerState) -> None:
    solo = {m: chat(state, m) for m in ("qwen2", "beta")}
    assert solo["qwen2"] != solo["beta"]

    async def main() -> list[tuple[str, str]]:
        transport = httpx.ASGITransport(app=create_app(state, own_state=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            async def one(i: int) -> tuple[str, str]:
                model = ("qwen2", "beta:latest")[i % 2]
                r = await c.post(CHAT, json={"model": model, "messages": MSG, "max_tokens": 8,
                                             "temperature": 0})
                return model.removesuffix(":latest"), r.json()["choices"][0]["message"]["content"]
            return await asyncio.gather(*(one(i) for i in range(8)))

    for model, text in asyncio.run(main()):
        assert text == solo[model]


def test_an_idle_model_unloads_after_keep_alive_and_comes_back(models: list[Path]) -> None:
    st = serve(models, keep_alive=0.2)
    try:
        first = chat(st, "beta")
        assert [lm.name for lm in st.loaded()] == ["qwen2", "beta"]
        deadline = time.monotonic() + 10
        while len(st.loaded()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [lm.name for lm in st.loaded()] == ["qwen2"]  # the first model stays
        assert chat(st, "beta") == first  # loads again, same answer
    finally:
        st.stop()


def test_models_max_unloads_the_least_recently_used(models: list[Path]) -> None:
    st = serve(models, models_max=2)
    try:
        chat(st, "beta")
        time.sleep(1.1)  # beta is idle now
        chat(st, "gamma")
        deadline = time.monotonic() + 10
        while "beta" in [lm.name for lm in st.loaded()] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [lm.name for lm in st.loaded()] == ["qwen2", "gamma"]
    finally:
        st.stop()


def test_ollama_keep_alive_per_request(models: list[Path]) -> None:
    st = serve(models)
    try:
        r = call(st, "POST", "/api/generate", json={"model": "beta", "prompt": "hi",
                                                    "stream": False, "keep_alive": "0s",
                                                    "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while len(st.loaded()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [lm.name for lm in st.loaded()] == ["qwen2"]
        assert call(st, "POST", "/api/generate", json={
            "model": "beta", "prompt": "x", "keep_alive": "soon"}).status_code == 400
    finally:
        st.stop()


def test_unknown_names_go_to_the_default_model_unless_strict(models: list[Path]) -> None:
    """OpenAI's and Anthropic's clients send their own model names: the default model takes
    them (as llama-server ignores the name), the same answer as named; Ollama's API keeps
    Ollama's 404. With --strict-model-names they are 404s listing the models."""
    st = serve(models)
    try:
        assert chat(st, "gpt-4o") == chat(st, "qwen2") != chat(st, "beta")
        r = call(st, "POST", "/v1/messages", json={"model": "claude-sonnet-4-5",
                                                   "max_tokens": 2, "messages": MSG})
        assert r.status_code == 200, r.text
        r = call(st, "POST", "/api/chat", json={"model": "nope", "messages": MSG})
        assert r.status_code == 404 and "beta:latest" in r.json()["error"]
    finally:
        st.stop()
    st = serve(models, strict_model_names=True)
    try:
        r = call(st, "POST", CHAT, json={"model": "gpt-4", "messages": MSG})
        assert r.status_code == 404
        assert "qwen2, beta, gamma" in r.json()["error"]["message"]
        r = call(st, "POST", "/v1/messages", json={"model": "nope", "max_tokens": 2,
                                                   "messages": MSG})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert chat(st, "beta:latest") == chat(st, "beta")
    finally:
        st.stop()


def test_unnamed_embeddings_go_to_a_served_encoder(models: list[Path],
                                                   tmp_path: Path) -> None:
    """A coder served first and an encoder beside it (what plain `minfer serve` serves after
    `minfer pull all-minilm-l6-v2`): unnamed or unknown-named embeddings load and use the
    encoder; chat stays on the coder; the banner says which model takes what."""
    from minfer.cli.serve_cmd import served_lines
    from minfer.tools.synth import write_tiny_bert

    encoder = write_tiny_bert(tmp_path / "minilm.gguf")
    st = serve([models[0], models[1], encoder])
    try:
        assert [e.lm for e in st.extra.values()] == [None, None]  # nothing loaded yet
        for body in ({"input": "hello"}, {"input": "hello", "model": "text-embedding-3-small"}):
            r = call(st, "POST", "/v1/embeddings", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "minilm" and len(r.json()["data"][0]["embedding"]) == 64
        assert st.extra["beta"].lm is None  # the other generative model was not loaded
        assert chat(st, "") == chat(st, "qwen2")
        r = call(st, "POST", "/v1/rerank", json={"query": "q", "documents": ["a"]})
        assert r.status_code == 400 and "--pooling" in r.json()["error"]["message"]
        assert served_lines(st) == [
            "qwen2 (generates; default for chat / completions)",
            "beta (generates, loaded on first use)",
            "minilm (embeds, loaded on first use; default for embeddings)"]
    finally:
        st.stop()


def test_one_model_takes_any_name(tiny_qwen2: Path) -> None:
    st = make_state(tiny_qwen2)
    st.start()
    try:
        assert st.wait_ready(30)
        assert chat(st, "gpt-4") == chat(st, "qwen2")  # OpenAI clients send their own names
    finally:
        st.stop()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


@pytest.mark.real_model
@pytest.mark.slow
def test_real_models_alternate_and_an_idle_one_gives_its_memory_back(
        real_model_path: Path) -> None:
    from minfer.store.download import pull
    from tests.test_server_process import serving

    gemma = pull("gemma-3-270m", progress=False)
    prompts = [[{"role": "user", "content": f"Write the number {i} in words."}]
               for i in range(4)]
    with serving(real_model_path, "-m", str(gemma), "--keep-alive", "2", "--slots", "2",
                 "--n-ctx", "512", timeout=600) as srv:
        c = srv.client()
        names = [m.id for m in c.models.list().data]
        assert names == [real_model_path.stem, gemma.stem]
        solo = {(name, i): c.chat.completions.create(
            model=name, messages=p, max_tokens=12, temperature=0).choices[0].message.content  # type: ignore[arg-type]
            for name in names for i, p in enumerate(prompts)}
        loaded = rss_mb(srv.proc.pid)

        async def main() -> list[tuple[tuple[str, int], str | None]]:
            client = srv.aclient()

            async def one(k: int) -> tuple[tuple[str, int], str | None]:
                name, i = names[k % 2], (k // 2) % len(prompts)
                r = await client.chat.completions.create(
                    model=name, messages=prompts[i], max_tokens=12, temperature=0)  # type: ignore[arg-type]
                return (name, i), r.choices[0].message.content

            return await asyncio.gather(*(one(k) for k in range(8)))

        for key, text in asyncio.run(main()):
            assert text == solo[key], key
        deadline = time.monotonic() + 30
        while srv.gauge("minfer_models_loaded") > 1 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert srv.gauge("minfer_models_loaded") == 1
        deadline = time.monotonic() + 15  # the engine's arrays go back as its thread ends
        while rss_mb(srv.proc.pid) >= loaded - 30 and time.monotonic() < deadline:
            time.sleep(0.25)
        unloaded = rss_mb(srv.proc.pid)
        print(f"server RSS with both models {loaded:.0f} MB, after Gemma unloaded "
              f"{unloaded:.0f} MB")
        assert unloaded < loaded - 30  # Gemma's touched weights and its engine went back


def test_anthropics_client_lists_and_retrieves_the_models(state: ServerState) -> None:
    """`/v1/models` in Anthropic's shapes for its client (it sends `anthropic-version`): pages
    by `limit` / `after_id` / `before_id`, one model by name, errors as Anthropic's objects;
    OpenAI's client on the same path still gets OpenAI's list."""
    import anthropic

    from tests.test_server_anthropic import with_client

    async def go(c: anthropic.AsyncAnthropic) -> dict[str, Any]:
        first = await c.models.list(limit=2)
        every = [m.id async for m in await c.models.list(limit=1)]  # follows the cursors
        before = await c.models.list(before_id="gamma", limit=1)
        one = await c.models.retrieve("beta")
        with pytest.raises(anthropic.NotFoundError) as missing:
            await c.models.retrieve("nope")
        with pytest.raises(anthropic.BadRequestError) as bad:
            await c.models.list(limit=0)
        return {"first": first, "every": every, "before": before, "one": one,
                "missing": missing.value.body, "bad": bad.value.body}

    got = with_client(state, go)
    first = got["first"]
    assert [m.id for m in first.data] == ["qwen2", "beta"] and first.has_more
    assert (first.first_id, first.last_id) == ("qwen2", "beta")
    assert got["every"] == ["qwen2", "beta", "gamma"]
    assert [m.id for m in got["before"].data] == ["beta"] and got["before"].has_more
    one = got["one"]
    assert (one.id, one.type, one.display_name, one.lifecycle) == ("beta", "model", "beta",
                                                                    "active")
    assert one.created_at.year >= 2020 and one.max_input_tokens
    for body, kind in ((got["missing"], "not_found_error"), (got["bad"], "invalid_request_error")):
        assert body["type"] == "error" and body["error"]["type"] == kind, body
    plain = call(state, "GET", "/v1/models").json()
    assert plain["object"] == "list" and [m["object"] for m in plain["data"]] == ["model"] * 3


def test_the_official_clients_with_their_own_model_names(state: ServerState) -> None:
    """OpenAI's client asking for "gpt-4o" and Anthropic's for "claude-sonnet-4-5" on a server
    of several models: the default model answers both, the same greedy text as named."""
    import anthropic
    import openai

    from tests.test_server_anthropic import with_client

    named = chat(state, "qwen2")

    async def ask_openai() -> str | None:
        transport = httpx.ASGITransport(app=create_app(state, own_state=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,
                                   max_retries=0)
            r = await c.chat.completions.create(model="gpt-4o", messages=MSG,  # type: ignore[arg-type]
                                                max_tokens=8, temperature=0)
            return r.choices[0].message.content

    assert asyncio.run(ask_openai()) == named

    async def ask_anthropic(c: anthropic.AsyncAnthropic) -> Any:
        return await c.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=MSG,  # type: ignore[arg-type]
                                       extra_body={"temperature": 0})

    msg = with_client(state, ask_anthropic)
    assert msg.content[0].text == named
