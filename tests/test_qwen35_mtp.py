"""Qwen3.5's MTP (NextN) head: a file that carries it loads, the head's graph against a float64
transformers reference, the target's every-row hidden states that feed it, and the head as a
speculative proposer (`--spec mtp`): greedy output unchanged, acceptance counted.

tests/fixtures/qwen35/qwen35_mtp.gguf and mtp.npz come from benchmarks/make_qwen35_fixtures.py
(`make_mtp`): the tiny dense checkpoint of test_qwen35.py's shape with one MTP block added to
its safetensors as Qwen3.5's checkpoints store it (`mtp.*`), converted by llama.cpp 0.3.36's
`convert_hf_to_gguf.py` without --no-mtp (`blk.4.nextn.*`, `nextn_predict_layers` 1); the
reference is transformers' own modules in float64 on 40 token ids: the trunk's final normed
hidden states (`hidden`) and logits (`hf`), and the head's normed rows and logits with each
position q taking token q and hidden[q - 1] (`mtp_hidden`, `mtp_logits`). The same for the MoE
trunk with an MoE block (`qwen35moe_mtp.gguf`, `mtp_moe.npz`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from minfer.engine.forward import Batch, Engine
from minfer.errors import ModelError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
MODEL = FIXTURES / "qwen35_mtp.gguf"
REF = np.load(FIXTURES / "mtp.npz")
IDS = REF["ids"].tolist()
MOE = FIXTURES / "qwen35moe_mtp.gguf"  # the MoE trunk and an MoE MTP block (experts, shared)
KINDS = {"dense": (MODEL, "mtp.npz"), "moe": (MOE, "mtp_moe.npz")}


def _model() -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(MODEL)
    return f, HParams.from_gguf(f)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _sink(engine: Engine) -> list[np.ndarray]:
    seen: list[np.ndarray] = []
    engine.hidden_sink = lambda batch, hidden: seen.append(hidden.copy())
    return seen


def test_mtp_file_loads_with_its_trunk_and_head_view() -> None:
    f, hp = _model()
    assert (hp.n_layer, hp.n_layer_nextn, hp.first_layer) == (4, 1, 0)
    head = hp.mtp_head()
    assert (head.n_layer, head.first_layer, head.recurrent) == (5, 4, False)
    assert [head.layer_kv_embd(il) for il in range(5)] == [0, 0, 0, 0, 2 * 32]
    names = {name for name, _ in head.expected_shapes()}
    assert "blk.4.nextn.eh_proj.weight" in names and "blk.4.attn_q.weight" in names
    assert not any(name.startswith("blk.3.") for name in names)
    logits = Engine(f, hp, n_ctx=64, kv_type="f32").forward(IDS, 0, len(IDS))
    assert _rel(logits, REF["hf"]) < 1e-3
    g = GGUFFile.open(FIXTURES / "qwen35.gguf")
    with pytest.raises(ModelError, match="no MTP"):
        HParams.from_gguf(g).mtp_head()


def test_target_hidden_rows_every_row_and_logits_unchanged() -> None:
    """With a sink, every row's final normed hidden state comes out beside the logits (a
    prefill's too, not just its tail), and the logits are bitwise those without it."""
    f, hp = _model()
    plain = Engine(f, hp, n_ctx=64, kv_type="f32")
    want = plain.forward(IDS, 0, 1)
    engine = Engine(f, hp, n_ctx=64, kv_type="f32")
    seen = _sink(engine)
    got = engine.forward(IDS, 0, 1)  # a prefill keeping one tail row
    np.testing.assert_array_equal(got, want)
    assert seen[-1].shape == (len(IDS), hp.n_embd)
    assert float(np.abs(seen[-1] - REF["hidden"]).max()) < 1e-3
    engine.forward(IDS[:5], 0, 5)  # a graph of every row: its normed rows
    np.testing.assert_allclose(seen[-1], seen[0][:5], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_mtp_head_logits_match_transformers_float64(kind: str) -> None:
    """The head on the reference's own hidden states: position q takes token q and the
    target's hidden state of row q - 1 (zeros at 0), its attention over positions 0..q (the
    MoE's block: routed experts and the gated shared expert)."""
    path, npz = KINDS[kind]
    ref = np.load(FIXTURES / npz)
    f = GGUFFile.open(path)
    hp = HParams.from_gguf(f)
    assert _rel(Engine(f, hp, n_ctx=64, kv_type="f32").forward(IDS, 0, len(IDS)),
                ref["hf"]) < 1e-3
    head = Engine(f, hp.mtp_head(), n_ctx=64, kv_type="f32")
    seen = _sink(head)
    prev = np.concatenate([np.zeros((1, hp.n_embd), np.float32), ref["hidden"][:-1]])
    batch = replace(Batch.single(IDS, 0, len(IDS)), hidden=prev)
    logits = head.forward_batch(batch)
    assert _rel(logits, ref["mtp_logits"]) < 1e-4
    assert float(np.abs(seen[-1] - ref["mtp_hidden"]).max()) < 1e-4
    # a prefill keeping the last row, then one row more over the cells it wrote
    n = len(IDS) - 1
    tail = head.forward_batch(replace(Batch.single(IDS[:n], 0, 1), hidden=prev[:n]))
    np.testing.assert_allclose(tail[0], logits[n - 1], rtol=0, atol=1e-4)
    step = head.forward_batch(replace(Batch.single(IDS[n:], n, 1), hidden=prev[n:]))
    np.testing.assert_allclose(step[0], logits[n], rtol=0, atol=1e-4)


# -- the head as a proposer ----------------------------------------------------------------------
PROMPT = IDS[:12]


def _generate(spec: object | None, *, max_tokens: int = 40, prompt: list[int] = PROMPT,
              path: Path = MODEL, **sampling: float) -> object:
    import minfer
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    model = minfer.load(path, n_ctx=128, kv_type="f32", threads=1)
    speculator = None if spec is None else model.speculator(spec)  # type: ignore[arg-type]
    params = SamplerParams(temp=0.0, **sampling)  # type: ignore[arg-type]
    events = list(model.stream(prompt, max_tokens=max_tokens, sampling=params,
                               speculator=speculator))
    done = events[-1]
    assert isinstance(done, Finished)
    return done, speculator


@pytest.mark.parametrize(("kind", "adaptive"), [("dense", False), ("dense", True),
                                               ("moe", False)])
def test_spec_mtp_greedy_output_equals_plain_decoding(kind: str, adaptive: bool) -> None:
    """`--spec mtp`: the head drafts, the hybrid target verifies (state kept before the verify,
    the kept tokens recomputed); the output is plain decoding's, token for token, and the
    drafted / accepted counts are in the stats."""
    from minfer.engine.core.mtp import MtpProposer
    from minfer.engine.speculative import SpecConfig

    path = KINDS[kind][0]
    plain, _ = _generate(None, path=path, repeat_penalty=1.2)
    spec = SpecConfig(mtp=True, adaptive=adaptive, p_min=0.0, draft_max=4)
    got, speculator = _generate(spec, path=path, repeat_penalty=1.2)
    assert got.ids == plain.ids and got.reason == plain.reason  # type: ignore[attr-defined]
    assert got.n_past == plain.n_past  # type: ignore[attr-defined]
    stats = got.speculation  # type: ignore[attr-defined]
    mtp = speculator.proposer  # type: ignore[attr-defined]
    assert isinstance(mtp, MtpProposer)
    # the generation over, the target stops computing hidden rows (prefill keeps n_out rows)
    assert mtp.target is not None and mtp.target.hidden_sink is None
    if not adaptive:
        assert stats is not None and stats.drafted > 0 and stats.steps > 0
        assert 0 <= stats.accepted <= stats.drafted
        assert speculator.stats.drafted == stats.drafted  # type: ignore[attr-defined]


def test_mtp_proposer_drafts_what_the_head_computes_on_the_targets_rows() -> None:
    """The proposer's first draft is the head's argmax at the pending token, paired with the
    target's hidden state of the row before; its record follows the target's rows."""
    from minfer.engine.core.mtp import MtpProposer
    from minfer.engine.core.proposer import DraftAsk

    f, hp = _model()
    target = Engine(f, hp, n_ctx=64, kv_type="f32")
    mtp = MtpProposer(lambda n: Engine(f, hp.mtp_head(), n_ctx=n, kv_type="f32"), p_min=0.0,
                      chunk=16)
    mtp.attach(target)
    n = 20
    target.forward(IDS[:n], 0, 1)  # the prompt; IDS[n] stands for the token drawn after it
    assert (mtp.known[0, :n] == IDS[:n]).all() and (mtp.known[0, n:] == -1).all()
    out = mtp.propose([DraftAsk(7, 0, tuple(IDS[:n + 1]), 3)])
    assert mtp.cached[0] == IDS[:n + 1]  # through the pending token, not the drafts
    head = Engine(f, hp.mtp_head(), n_ctx=64, kv_type="f32")
    prev = np.concatenate([np.zeros((1, hp.n_embd), np.float32), mtp.hidden[0, :n]])
    want = head.forward_batch(replace(Batch.single(IDS[:n + 1], 0, 1), hidden=prev))
    tokens = out[7].tokens
    assert len(tokens) == 3 and tokens[0] == int(np.argmax(want[0]))
    assert mtp.n_forwards == 2 + 2  # two catch-up chunks of 16 and 5 rows, two draft steps


def test_serve_slots_with_the_mtp_head_keep_every_greedy_text() -> None:
    """`minfer serve --spec mtp`: the head drafts for every slot of the batch-invariant
    hybrid target, its KV in the target's slot layout; each request's text is the one it gets
    without speculation, one slot at a time, and the drafts are counted."""
    import asyncio

    from minfer.engine.assembly import Assembly, ModelConfig
    from minfer.engine.core.request import GenRequest
    from minfer.engine.speculative import SpecConfig
    from minfer.sampling.params import SamplerParams
    from minfer.sampling.sampler import Sampler
    from minfer.server.metrics import Metrics
    from minfer.server.worker import Delta, Done, Handle, Worker

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 300, int(rng.integers(5, 30))).tolist() for _ in range(5)]
    lengths = [int(n) for n in rng.integers(8, 24, len(prompts))]

    def run(spec: SpecConfig | None, n_slots: int, metrics: Metrics) -> list[str]:
        parts = Assembly(MODEL, ModelConfig.build(n_ctx=64, kv_type="f32", threads=1,
                                                  batch_invariant=True, spec=spec))
        w = Worker(parts.engine, parts.tokenizer, n_slots=n_slots, n_ctx_slot=64, chunk=16,
                   metrics=metrics, speculation=spec, mtp=parts.mtp_proposer())
        w.start()
        assert w.ready.wait(60) and w.error is None

        async def one(prompt: list[int], n: int) -> str:
            handle = Handle(asyncio.get_running_loop())
            params = SamplerParams.greedy()
            w.submit(GenRequest(prompt=prompt, max_tokens=n,
                                sampler=Sampler(params, parts.hparams.n_vocab, seed=0)), handle)
            text = []
            while True:
                ev = await asyncio.wait_for(handle.events.get(), 60)
                if isinstance(ev, Delta):
                    text.append(ev.text)
                else:
                    assert isinstance(ev, Done)
                    return f"{''.join(text)!r} {ev.finish_reason} {ev.usage.completion_tokens}"

        async def main() -> list[str]:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths,
                                                                     strict=True)))
        try:
            return asyncio.run(main())
        finally:
            w.stop()

    plain = run(None, 1, Metrics())
    metrics = Metrics()
    got = run(SpecConfig(mtp=True, adaptive=False, p_min=0.0, draft_max=4), 3, metrics)
    assert got == plain
    assert metrics.draft_tokens.total() > 0


def test_chat_turns_and_regen_are_unchanged_by_the_mtp_head() -> None:
    """Through the chat session's KV mirror (delta prefill from state checkpoints, `/regen`):
    each turn's ids and the cells the KV holds are the same with the MTP head drafting."""
    import minfer
    from minfer.chat.session import ChatConfig, ChatSession, TurnReport
    from minfer.engine.speculative import SpecConfig
    from minfer.sampling.params import SamplerParams

    def replies(mtp: bool) -> tuple[list[list[int]], int]:
        model = minfer.load(MODEL, n_ctx=256, kv_type="f32", threads=1)
        speculator = model.speculator(SpecConfig(mtp=True, p_min=0.0, adaptive=False)) \
            if mtp else None
        sampler = model.sampler(SamplerParams(temp=0.0, repeat_penalty=1.3), 0, 256)
        session = ChatSession(model.engine(), model.tokenizer, model.chat_template, sampler,
                              config=ChatConfig(max_tokens=12), speculator=speculator)
        out, drafted = [], 0
        for turn in (lambda: session.say("the quick brown fox"),
                     lambda: session.say("the lazy dog"), session.regen):
            *_, report = turn()
            assert isinstance(report, TurnReport)
            out.append(report.ids)
            drafted += report.drafted
        out.append(session.kv.tokens)
        return out, drafted

    plain, _ = replies(False)
    got, drafted = replies(True)
    assert got == plain and drafted > 0


def test_cli_run_drafts_with_the_head_by_default_and_not_with_spec_none(
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from minfer.cli.main import main

    def run(*extra: str) -> dict[str, object]:
        assert main(["run", "--json", str(MODEL), "the fox and the dog", "--raw", "--temp", "0",
                     "-n", "16", "--draft-p-min", "0", *extra]) == 0
        out: dict[str, object] = json.loads(capsys.readouterr().out)
        return out

    plain = run("--spec", "none")
    assert "speculative" not in plain
    for extra in ((), ("--spec", "mtp", "--draft-fixed")):
        got = run(*extra)
        spec = got["speculative"]
        assert got["ids"] == plain["ids"] and isinstance(spec, dict)
        assert set(spec) >= {"drafted", "accepted", "acceptance_rate"}
    assert main(["run", str(FIXTURES / "qwen35.gguf"), "hi", "--spec", "mtp"]) != 0
    assert "no MTP" in capsys.readouterr().err
    assert main(["run", str(MODEL), "hi", "--spec", "mtp", "--lookup-ngram", "2"]) != 0
    assert "proposes alone" in capsys.readouterr().err
