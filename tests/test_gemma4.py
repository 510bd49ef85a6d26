"""Gemma 4 (`gemma4`, the E2B / E4B text decoder) as llama.cpp 0.3.36 reads and runs it,
against transformers on the same weights and token ids.

tests/fixtures/gemma4/ comes from benchmarks/make_gemma4_fixtures.py: a tiny random
`Gemma4ForCausalLM` (n_embd 64, 7 layers [swa, swa, full, swa, full, swa, full], window 5,
head size 16 sliding / 32 global with a quarter of it rotated, per-layer embeddings of 8, the
last 2 layers on layers 3's and 4's KV with double-wide FFNs, layer scalars away from 1,
final soft-cap 30)
converted by llama.cpp's `convert_hf_to_gguf.py` to f32. minfer's GELU is ggml's (the input
rounded to f16 and looked up in a table), so against transformers' own GELU the logits differ
by that rounding carried through 7 layers (9e-4 of the largest logit at the last position, up
to 1.4e-3 elsewhere); against transformers with ggml's GELU (`gemma4.hf_gelu_table`) only f32
rounding and an occasional f16 tie flipped remain (5e-5 at the last position).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.chat.reasoning import GEMMA4, THINK, ReasoningOptions, ReasoningStream, template_thinks
from minfer.engine.forward import Batch, Engine
from minfer.engine.kv_shift import shift_kv
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph.params import ContextParams, GraphParams
from minfer.models.registry import graph_builder_for
from minfer.tokenizer.chat import ChatTemplate

FIXTURES = Path(__file__).parent / "fixtures" / "gemma4"
TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "google-gemma-4-31B-it.jinja"
MODEL = FIXTURES / "gemma4.gguf"
REF = np.load(FIXTURES / "logits.npz")
IDS = REF["ids"].tolist()
RNG = np.random.default_rng(4)
LONG = RNG.integers(3, 254, 40).tolist()
OTHER = RNG.integers(3, 254, 12).tolist()


def _model(name: str = "gemma4") -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(FIXTURES / f"{name}.gguf")
    return f, HParams.from_gguf(f)


def _engine(name: str = "gemma4", **kw: object) -> Engine:
    f, hp = _model(name)
    kw.setdefault("n_ctx", 128)
    kw.setdefault("kv_type", "f32")
    return Engine(f, hp, **kw)  # type: ignore[arg-type]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_hparams_are_read_as_llamacpp_reads_them() -> None:
    _, hp = _model()
    assert hp.arch == "gemma4" and hp.kq_scale == 1.0 and hp.v_norm
    assert hp.swa_layers == (True, True, False, True, False, True, False)
    assert [hp.layer_head_dim(il) for il in range(7)] == [16, 16, 32, 16, 32, 16, 32]
    assert [hp.layer_rope_dim(il) for il in range(7)] == [16, 16, 32, 16, 32, 16, 32]
    assert (hp.rope_base, hp.rope_base_swa, hp.sliding_window) == (1e6, 1e4, 5)
    assert hp.n_layer_kv == 5 and [hp.kv_layer(il) for il in range(7)] == [0, 1, 2, 3, 4, 3, 4]
    assert [hp.layer_kv_embd(il) for il in range(7)] == [32, 32, 64, 32, 64, 0, 0]
    assert hp.n_embd_per_layer == 8 and hp.final_softcap == 30.0
    assert hp.layer_ff == (128,) * 5 + (256, 256)  # the shared layers' double-wide MLP
    assert len(hp.layer_scales) == 7 and min(hp.layer_scales) < 0.9 < 1.1 < max(hp.layer_scales)


def test_graph_shares_kv_and_adds_the_per_layer_inputs() -> None:
    f, hp = _model()
    params = GraphParams.for_batch(5, 1, ContextParams(n_ctx=64))
    graph = graph_builder_for("gemma4")(hp, params, {n: t.shape for n, t in f.tensors.items()})
    stores = [n.op.layer for n in graph.nodes if n.op.kind == "KvcacheStore"]  # type: ignore[attr-defined]
    assert stores == [0, 1, 2, 3, 4]  # the shared layers store nothing
    attn = [n.op for n in graph.nodes if n.op.kind == "Attn"]
    assert [a.cache_layer for a in attn] == [0, 1, 2, 3, 4, 3, 4]  # type: ignore[attr-defined]
    assert [a.window for a in attn] == [5, 5, 0, 5, 0, 5, 0]  # type: ignore[attr-defined]
    assert [a.scale for a in attn] == [1.0] * 7  # type: ignore[attr-defined]
    ropes = [n for n in graph.nodes if n.name == "rope_q"]
    assert [bool(n.meta.weights) for n in ropes] == [False, False, True, False, True, False, True]
    names = [n.name for n in graph.nodes]
    assert names.count("attn_v_norm") == 5 and names.count("per_layer_resid") == 7
    assert names.count("layer_out_scale") == 7 and "output_softcap" in names


def test_matches_transformers() -> None:
    got = _engine().forward(IDS, 0, n_out=len(IDS))
    table = REF["gemma4.hf_gelu_table"]  # transformers with ggml's GELU: the same function
    assert _rel(got[-1], table[-1]) < 1e-3
    assert _rel(got, table) < 1e-3
    plain = REF["gemma4.hf"]  # transformers' own GELU: its f16 rounding carried through
    assert _rel(got[-1], plain[-1]) < 1e-2 and (got.argmax(-1) == plain.argmax(-1)).all()
    f16 = _engine(kv_type="f16").forward(IDS, 0, n_out=len(IDS))
    assert _rel(f16, table) < 3e-2


def test_dense_31b_layout_matches_transformers() -> None:
    """The 26B / 31B's attention: global layers with 1 K/V head of 2 and no attn_v (V is K's
    projection, normed on its own), sliding ones as E2B's."""
    _, hp = _model("gemma4_31b")
    assert hp.layer_kv_heads == (2, 1, 2, 1) and hp.v_from_k == (False, True, False, True)
    assert not hp.n_embd_per_layer and not hp.n_layer_kv
    got = _engine("gemma4_31b").forward(IDS, 0, n_out=len(IDS))
    assert _rel(got, REF["gemma4_31b.hf_gelu_table"]) < 1e-4
    plain = REF["gemma4_31b.hf"]
    assert _rel(got[-1], plain[-1]) < 1e-3 and (got.argmax(-1) == plain.argmax(-1)).all()


def test_26b_a4b_experts_match_transformers() -> None:
    """The 26B-A4B's FFN: the dense GeGLU and 2 of 4 experts ([gate | up] in one tensor,
    renormalised top-k weights times each expert's scale) behind their own norms, summed."""
    f, hp = _model("gemma4_26b")
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff) == (4, 2, 32, 96)
    params = GraphParams.for_batch(5, 1, ContextParams(n_ctx=64))
    graph = graph_builder_for("gemma4")(hp, params, {n: t.shape for n, t in f.tensors.items()})
    moe = [n.op for n in graph.nodes if n.op.kind == "Moe"]
    assert len(moe) == 4 and all(m.fused_gate_up and m.down_scale and m.norm  # type: ignore[attr-defined]
                                 and m.act == "gelu" for m in moe)  # type: ignore[attr-defined]
    got = _engine("gemma4_26b").forward(IDS, 0, n_out=len(IDS))
    assert _rel(got, REF["gemma4_26b.hf_gelu_table"]) < 1e-4
    plain = REF["gemma4_26b.hf"]
    assert _rel(got[-1], plain[-1]) < 1e-3 and (got.argmax(-1) == plain.argmax(-1)).all()
    decode = _engine("gemma4_26b", batch_invariant=True)
    whole = decode.forward(IDS, 0, n_out=len(IDS))
    rows = [decode.forward([t], i, n_out=1) for i, t in enumerate(IDS)]
    assert np.array_equal(np.concatenate(rows), whole)


def test_prefill_chunks_and_decode_are_bitwise_the_whole_prompt() -> None:
    """Batch invariance: 1-, 7- and 16-row chunks give each row the whole prompt's bits,
    past the window and through the shared-KV layers."""
    e = _engine(batch_invariant=True)
    whole = e.forward(LONG, 0, n_out=len(LONG))
    for chunk in (1, 7, 16):
        rows = [e.forward(LONG[s:s + chunk], s, n_out=len(LONG[s:s + chunk]))
                for s in range(0, len(LONG), chunk)]
        assert np.array_equal(np.concatenate(rows), whole), chunk


def test_rows_beside_another_sequence_are_bitwise_alone() -> None:
    alone = _engine(batch_invariant=True).forward(LONG, 0, n_out=len(LONG))
    other = _engine(batch_invariant=True).forward(OTHER, 0, n_out=len(OTHER))
    e = _engine(batch_invariant=True)
    n = len(OTHER)
    tokens = np.array([*LONG[:n], *OTHER], np.int32)
    pos = np.concatenate([np.arange(n), np.arange(n)]).astype(np.int32)
    base = np.repeat([0, 64], n).astype(np.int32)
    batch = Batch(tokens=tokens, positions=pos, cells=base + pos, kv_start=base,
                  kv_end=base + pos + 1, out_rows=np.arange(2 * n, dtype=np.int32))
    rows = e.forward_batch(batch)
    assert np.array_equal(rows[:n], alone[:n]) and np.array_equal(rows[n:], other)


def test_kv_cache_holds_only_the_layers_with_their_own_kv() -> None:
    e = _engine(n_ctx=16)
    assert [k.shape for k in e.kv.k] == [(16, 32), (16, 32), (16, 64), (16, 32), (16, 64),
                                         (0, 64), (0, 64)]
    assert e.kv.bytes_per_token == 2 * 4 * (3 * 32 + 2 * 64)


def test_shifted_block_equals_the_block_prefilled_at_its_new_place() -> None:
    """The context shift re-rotates each layer's keys with its own head size, rotary dims and
    rope (the factors only in the global layers) and skips the shared-KV layers."""
    src, dst, n = 50, 6, len(IDS)

    def block(start: int) -> Batch:  # tokens at cells start.. reading only their own block
        b = Batch.single(IDS, start, 1)
        return Batch(b.tokens, b.positions, b.cells, np.full(n, start, np.int32), b.kv_end,
                     b.out_rows)

    moved, fresh = _engine(), _engine()
    moved.forward_batch(block(src))
    shift_kv(moved, src_start=src, src_end=src + n, dst_start=dst)
    fresh.forward_batch(block(dst))
    # layer 0's keys see only the rotation; later layers' also the earlier layers' outputs,
    # where an f32 rounding of the rope may flip an f16 GELU table entry
    for layer, tol in ((0, 2e-5), (1, 1e-3), (2, 1e-3), (3, 1e-3), (4, 1e-3)):
        got, want = moved.kv.k[layer][dst:dst + n], fresh.kv.k[layer][dst:dst + n]
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), layer


def test_torch_backend_runs_it() -> None:
    """The torch backend takes the weightless V norm and the shared-KV attention too. Its bf16
    products alone (claim="matmul") move this model's large random logits by 10-20% of the
    largest (7 layers of weights 0.3 wide), so this checks that it runs, not its precision."""
    pytest.importorskip("torch")
    from minfer.backends.cpu.backend import CpuBackend
    from minfer.backends.torch_backend.backend import TorchBackend

    ref = _engine().forward(IDS, 0, n_out=len(IDS))
    e = _engine(backends=[TorchBackend(device="cpu", min_rows=1), CpuBackend()])
    assert _rel(e.forward(IDS, 0, n_out=len(IDS)), ref) < 0.3


def test_info_explains_the_family(capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    assert main(["info", str(MODEL)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "32 (global layers) / 16 (sliding-window layers)" in out
    assert "(5<-3, 6<-4)" in out and "8 per layer" in out and "128 (256 in layers 5-6)" in out
    assert "scale 1, V RMS-normed per head" in out
    assert "f32 1.8 KiB" in out  # 3 x 32 + 2 x 64 floats of K and V a token, 4 bytes each
    assert main(["info", str(FIXTURES / "gemma4_31b.gguf")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "4 / 1 (global layers), 2 (sliding-window layers)" in out
    assert "V is K's" in out and "projection in layers 1, 3" in out
    assert main(["info", str(FIXTURES / "gemma4_26b.gguf")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 of 4 per token, each 32 wide" in out and "FFN 96 wide" in out


# -- the chat template and its thinking -------------------------------------------------------
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "City"}},
        "required": ["city"]}}}]
CALL = [{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "content": "18C, sunny"}]
TURNS = "<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n<|turn>user\nWeather?<turn|>\n"
DECL = ("<|tool>declaration:get_weather{description:<|\"|>Weather now<|\"|>,parameters:{"
        "properties:{city:{description:<|\"|>City<|\"|>,type:<|\"|>STRING<|\"|>}},required:"
        "[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}<tool|>")


def _template() -> ChatTemplate:
    return ChatTemplate(TEMPLATE.read_text(),
                        special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"})


@pytest.mark.parametrize(("messages", "tools", "kwargs", "want"), [
    (MSGS, None, {}, "<bos><|turn>system\nBe brief.<turn|>\n" + TURNS
     + "<|turn>model\n<|channel>thought\n<channel|>"),
    (MSGS, None, {"enable_thinking": True},
     "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n" + TURNS + "<|turn>model\n"),
    (CALL, TOOLS, {}, "<bos><|turn>system\n" + DECL + "<turn|>\n<|turn>user\nWeather?<turn|>\n"
     "<|turn>model\n<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>"
     "<|tool_response>response:get_weather{value:<|\"|>18C, sunny<|\"|>}<tool_response|>"),
])
def test_chat_template_renders_as_transformers(messages: list[dict[str, object]],
                                               tools: list[dict[str, object]] | None,
                                               kwargs: dict[str, object], want: str) -> None:
    """Gemma 4's template (llama.cpp's copy) renders what transformers 5.x's
    `render_jinja_template` renders (checked when these strings were written): the empty
    thought channel without thinking, the `<|think|>` switch with it, tool declarations,
    calls and responses in its own syntax."""
    assert _template().render(messages, add_generation_prompt=True, tools=tools,
                              **kwargs) == want


def test_thinking_is_split_from_the_thought_channel() -> None:
    t = _template()
    assert template_thinks(t.source, t.variables)
    encode = lambda s: [ord(c) for c in s]  # noqa: E731  (the tags' ids do not matter here)
    opts = ReasoningOptions()
    thinking = opts.plan(t.render(MSGS, enable_thinking=True), encode,
                         template_source=t.source)
    assert thinking.tags == GEMMA4 and not thinking.in_reasoning
    reply = "<|channel>thought\nThe user asks.\n<channel|>Sunny."
    split = thinking.split(reply)
    assert (split.content, split.reasoning) == ("Sunny.", "The user asks.")
    # streamed a character at a time: the same values, nothing given out too early
    stream = ReasoningStream(tags=GEMMA4)
    pieces = [stream.push(c) for c in reply] + [stream.finish()]
    assert "".join(c for c, _ in pieces) == "Sunny."
    assert "".join(r for _, r in pieces) == "The user asks."
    # without a template source (the Python API) the rendered prompt tells the tags apart
    off = opts.plan(t.render(MSGS), encode)
    assert off.tags == GEMMA4 and off.split("Sunny.").content == "Sunny."
    assert opts.plan("<|im_start|>assistant\n", encode).tags == THINK


# -- tool calls in Gemma 4's own notation ---------------------------------------------------------
G4_CALL = ('<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,opts:{metric:true,'
           'tags:[<|"|>a<|"|>, null, -1.5e2]}}<tool_call|>')
G4_ARGS = '{"city":"Paris, \\"FR\\"","days":3,"opts":{"metric":true,"tags":["a",null,-1.5e2]}}'


def test_gemma4_calls_parse_as_llama_cpp_writes_their_arguments() -> None:
    """`gemma4_to_json`'s output: compact JSON, keys quoted, `<|"|>` strings escaped."""
    from minfer.sampling.gemma4_calls import parse_call

    assert parse_call(G4_CALL[len("<|tool_call>call:"):-len("<tool_call|>")]) == \
        ("get_weather", G4_ARGS)
    assert parse_call("f{}") == ("f", "{}")
    assert parse_call("f{ a: 1, b:[ ] }") == ("f", '{"a":1,"b":[]}')
    assert parse_call('f{"a":1}') == ("f", '{"\\"a\\"":1}')  # a key as written
    for bad in ["f", "f{a:1", "f{a:1 ,b:2}", "f{a:<|\"|>x}", "f{a:1} tail", "{a:1}"]:
        assert parse_call(bad) is None, bad


def test_gemma4_replies_split_into_content_and_calls_whole_and_streamed() -> None:
    from minfer.sampling.tool_calls import GEMMA4, ToolCallStream, tool_segments, tool_syntax

    t = _template()
    assert tool_syntax(t.source) is GEMMA4 and tool_syntax("{{ messages }}") is not GEMMA4
    text = "Let me look.\n" + G4_CALL + G4_CALL.replace("get_weather", "get_time")
    parts = tool_segments(text, new_id=lambda: "c", syntax=GEMMA4)
    assert parts[0] == "Let me look.\n"
    calls = [p for p in parts if not isinstance(p, str)]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", G4_ARGS), ("get_time", G4_ARGS)]
    # a Hermes block is text to Gemma 4; a Gemma 4 call that never closes stays text
    assert tool_segments('<tool_call>{"name": "f", "arguments": {}}</tool_call>',
                         syntax=GEMMA4)[0].startswith("<tool_call>")
    assert tool_segments(G4_CALL[:-3], syntax=GEMMA4) == [G4_CALL[:-3]]
    for size in (1, 3, 7):
        stream = ToolCallStream(new_id=lambda: "c", syntax=GEMMA4)
        deltas = [d for i in range(0, len(text), size) for d in stream.push(text[i:i + size])]
        deltas += stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == "Let me look."
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in stream.tool_calls] == [("get_weather", G4_ARGS), ("get_time", G4_ARGS)]


def test_gemma4_tool_calls_through_the_output_plan() -> None:
    """The server's plan reads a Gemma 4 reply's thinking and calls (whole and streamed, as
    every API shapes them); a forced tool_choice is refused by name (not yet built)."""
    from minfer.server.errors import APIError
    from minfer.server.output import plan_output
    from minfer.server.schemas import ChatCompletionRequest

    t = _template()
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather?"}],
                                tools=TOOLS)
    plan = plan_output(req, 10, None, template_source=t.source)
    plan.reasoning = ReasoningOptions().plan(t.render(MSGS, enable_thinking=True),
                                             lambda s: [ord(c) for c in s],
                                             template_source=t.source)
    reply = "<|channel>thought\nUse the tool.<channel|>" + G4_CALL
    fields, finish = plan.finalize(reply, "stop")
    assert finish == "tool_calls" and fields["reasoning_content"] == "Use the tool."
    assert fields["content"] is None
    assert [c["function"]["arguments"] for c in fields["tool_calls"]] == [G4_ARGS]
    stream = plan.reply_stream()
    deltas = [d for c in reply for d in stream.push(c)] + stream.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Use the tool."
    assert "".join(a["function"].get("arguments", "") for d in deltas
                   for a in d.get("tool_calls", [])) == G4_ARGS
    forced = req.model_copy(update={"tool_choice": "required"})
    with pytest.raises(APIError, match="vocabulary cannot be grammar-constrained"):
        plan_output(forced, 10, None, template_source=t.source)


# -- a forced tool_choice in Gemma 4's notation ----------------------------------------------------
G4_MARKS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")
FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module", params=["text", "control"])
def marked_vocab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 ) -> tuple[object, object]:
    """A tiny vocabulary holding Gemma 4's marks as user-defined tokens ("text") or as control
    tokens ("control": a grammar must name them as tokens, their bytes are not text to it)."""
    from minfer.sampling.grammar import GrammarVocab
    from minfer.tokenizer.tokenizer import Tokenizer
    from minfer.tools.synth import build_tiny_vocab, copy_gguf, write_tiny_model

    d = tmp_path_factory.mktemp("g4marks")
    vocab = build_tiny_vocab(extra_tokens=G4_MARKS)
    path = write_tiny_model(d / "text.gguf", vocab=vocab)
    if request.param == "control":
        types = np.array([3 if t in G4_MARKS else k
                          for t, k in zip(vocab.tokens, vocab.token_types, strict=True)],
                         dtype=np.int32)
        path = copy_gguf(path, d / "control.gguf", metadata={"tokenizer.ggml.token_type": types})
    tok = Tokenizer.from_gguf(GGUFFile.open(path))
    assert all(tok.is_control(tok.encode(m, special=True, add_bos=False)[0]) ==
               (request.param == "control") for m in G4_MARKS)
    return tok, GrammarVocab.from_tokenizer(tok)


def _walk(mask: object, tok: object, text: str) -> bool:
    """Feed text's tokens to a grammar mask: False at the first one it forbids."""
    for tid in tok.encode(text, special=True, add_bos=False):  # type: ignore[attr-defined]
        if not mask.allowed()[tid]:  # type: ignore[attr-defined]
            return False
        mask.accept(tid)  # type: ignore[attr-defined]
    return True


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_choice_grammar_makes_the_reply_gemma4_calls(
        marked_vocab: tuple[object, object], choice: object) -> None:
    """As llama.cpp's gemma4 grammar (common/parsers/gemma4.cpp) forces them: an optional
    thought channel, then calls `<|tool_call>call:NAME{...}<tool_call|>` to an offered
    function (the named one only), arguments in Gemma 4's object notation; whatever the
    marks are in the vocabulary, text or control tokens."""
    from minfer.sampling.grammar import GrammarMask
    from minfer.sampling.tool_calls import GEMMA4, tool_choice_grammar, tool_segments

    tok, vocab = marked_vocab
    grammar = tool_choice_grammar([*TOOLS, FORECAST], choice, template_source=_template().source,
                                  specials=vocab.specials)  # type: ignore[attr-defined]
    assert grammar is not None
    reply = "<|channel>thought\nUse the tool.<channel|>" + G4_CALL
    mask = GrammarMask(vocab, grammar)  # type: ignore[arg-type]
    assert _walk(mask, tok, reply) and mask.is_accepting()
    assert _walk(mask := GrammarMask(vocab, grammar), tok, G4_CALL) and mask.is_accepting()
    (call,) = [p for p in tool_segments(reply, syntax=GEMMA4) if not isinstance(p, str)]
    assert call["function"]["arguments"] == G4_ARGS
    for refused in ["Sunny.", "<|tool_call>call:get_time{}<tool_call|>",
                    '<|tool_call>call:get_weather{city:"Paris"}<tool_call|>',
                    "<|tool_call>call:get_weather{city:1 ,days:2}<tool_call|>"]:
        assert not _walk(GrammarMask(vocab, grammar), tok, refused), refused  # type: ignore[arg-type]
    named_only = isinstance(choice, dict)
    assert _walk(GrammarMask(vocab, grammar), tok,  # type: ignore[arg-type]
                 "<|tool_call>call:get_forecast{}<tool_call|>") is not named_only


def test_tool_results_render_back_in_gemma4_form() -> None:
    """The shipped template scans `tool` messages itself; an older one (without that scan)
    gets them as the assistant message's `tool_responses`, as llama.cpp's workaround builds
    them (a JSON result parsed), and both render the same turn."""
    from minfer.sampling.gemma4_calls import SCANS_TOOL_MESSAGES, gemma4_history
    from minfer.sampling.tool_calls import history_for

    t = _template()
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
               {"role": "assistant", "content": "It is 18C."}]
    assert gemma4_history(history, t.source) == history  # the shipped template: as they are
    want = ('<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
            '<|tool_response>response:get_weather{value:<|"|>{"temp": 18}<|"|>}'
            '<tool_response|>It is 18C.<turn|>\n')
    assert want in t.render(history_for(history, t.source, t.variables, TOOLS), tools=TOOLS)
    old = ChatTemplate(t.source.replace(SCANS_TOOL_MESSAGES, "{#- scan:"),
                       special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"})
    (turn,) = [m for m in gemma4_history(history, old.source) if m["role"] == "assistant"]
    assert turn["tool_responses"] == [{"name": "get_weather", "response": {"temp": 18}}]
    assert turn["content"] == "It is 18C."
    rendered = old.render(history_for(history, old.source, old.variables, TOOLS), tools=TOOLS)
    assert ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
            '<|tool_response>response:get_weather{temp:18}<tool_response|>It is 18C.') in rendered
