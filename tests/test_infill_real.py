"""Fill-in-the-middle on the development model against llama.cpp (tests/fixtures/
infill_llamacpp.json, made by scripts/make_infill_fixtures.py): the same prompt ids, token for
token, for every chunk kind and the budget cuts; and llama.cpp's greedy fill, diverging at most
at a step where llama.cpp's own top-2 margin is a near-tie."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minfer.engine.generate import Finished
from minfer.sampling.params import SamplerParams
from minfer.tokenizer.infill import Budget, ExtraFile, infill_prompt

pytestmark = [pytest.mark.real_model]

REF = json.loads((Path(__file__).parent / "fixtures" / "infill_llamacpp.json").read_text())
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def model(real_model_path: Path) -> Any:
    import minfer

    return minfer.load(real_model_path, n_ctx=4096, backend="cpu")


def _layout(model: Any, case: dict[str, Any]) -> list[int]:
    tok = model.tokenizer
    prompt = tok.encode(case["prompt"], special=True, add_bos=False) if case.get("prompt") else []
    extra = [ExtraFile(e["text"], e.get("filename", "tmp")) for e in case.get("input_extra", [])]
    budget = Budget(n_batch=case.get("n_batch", 2048), n_predict=case.get("n_predict", -1),
                    n_ctx=case.get("n_ctx", 4096))
    return infill_prompt(tok, case["input_prefix"], case["input_suffix"], extra=extra,
                         prompt=prompt, budget=budget)


def test_fim_tokens_found_by_text(model: Any) -> None:
    fim = model.tokenizer.fim
    assert {k: getattr(fim, k) for k in REF["fim"]} == REF["fim"]


@pytest.mark.parametrize("case", REF["cases"], ids=[c["name"] for c in REF["cases"]])
def test_layout_is_llamacpps_token_for_token(model: Any, case: dict[str, Any]) -> None:
    assert _layout(model, case) == case["ids"]


@pytest.mark.slow
@pytest.mark.parametrize("case", REF["cases"], ids=[c["name"] for c in REF["cases"]])
def test_greedy_fill_matches_llamacpp(model: Any, case: dict[str, Any]) -> None:
    ref = case["greedy_ids"]
    events = list(model.stream(case["ids"], max_tokens=len(ref),
                               sampling=SamplerParams(temp=0.0)))
    done = events[-1]
    assert isinstance(done, Finished)
    got = done.ids + ([done.eot_id] if done.eot_id is not None else [])
    for step, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            assert case["margins"][step] < NEAR_TIE, f"diverged at confident step {step}"
            return
    assert len(got) == len(ref)


def test_python_api_and_cli_lay_out_the_same_prompt(model: Any, capsys: pytest.CaptureFixture[str],
                                                    real_model_path: Path) -> None:
    from minfer.cli.main import main

    case = next(c for c in REF["cases"] if c["name"] == "plain")
    assert model.infill_ids(case["input_prefix"], case["input_suffix"]) == case["ids"]
    text = "".join(model.infill(case["input_prefix"], case["input_suffix"], max_tokens=4,
                                temp=0.0))
    assert main(["run", "--json", str(real_model_path), "--fim-prefix", case["input_prefix"],
                 "--fim-suffix", case["input_suffix"], "-n", "4", "--temp", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == case["ids"] and out["text"] == text
    assert out["ids"] == case["greedy_ids"][:len(out["ids"])]


def test_a_model_without_fim_tokens_is_refused_by_name(tiny_qwen2: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    assert main(["run", str(tiny_qwen2), "--fim-prefix", "a", "--fim-suffix", "b"]) != 0
    assert "fill-in-the-middle" in capsys.readouterr().err
