"""minfer's greedy ids on the public reference prompts, pinned bit for bit.

tests/fixtures/greedy_minfer.json holds the ids the tree before the one-engine-path refactor
produced (scripts/make_greedy_fixture.py), per instruction-set class: a change that leaves the
arithmetic alone (moving the generation loop, the op tape, the kernel folders) must leave every id
where it was. A CPU class without a recorded row is skipped, saying how to record one.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from minfer.engine.generate import Finished
from minfer.sampling.params import SamplerParams

pytestmark = [pytest.mark.real_model]

ROOT = Path(__file__).resolve().parent.parent
PINNED = json.loads((ROOT / "tests" / "fixtures" / "greedy_minfer.json").read_text())


def _isa_class() -> str:
    spec = importlib.util.spec_from_file_location("make_greedy_fixture",
                                                  ROOT / "scripts" / "make_greedy_fixture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.isa_class())


ISA = _isa_class()
CASES: list[dict[str, Any]] = PINNED["by_isa"].get(ISA, {}).get("cases", [])


@pytest.fixture(scope="module")
def model(real_model_path: Path) -> Any:
    import minfer

    return minfer.load(real_model_path, n_ctx=1024, kv_type="f16", backend="cpu")


@pytest.mark.skipif(not CASES, reason=f"no pinned ids for this CPU class ({ISA}): run "
                                      "scripts/make_greedy_fixture.py on a trusted tree")
@pytest.mark.parametrize("index", range(len(CASES) or 1))
def test_greedy_ids_are_pinned(model: Any, index: int) -> None:
    case = CASES[index]
    prompt_ids = model.tokenizer.encode(case["prompt"])
    events = list(model.stream(prompt_ids, max_tokens=PINNED["n_tokens"],
                               sampling=SamplerParams(temp=0.0)))
    done = events[-1]
    assert isinstance(done, Finished)
    assert done.ids == case["ids"]
    assert done.eot_id == case["eot_id"]
