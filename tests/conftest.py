"""Shared fixtures: two tiny synthetic models (a mix of tensor types) and the development model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QType

from minfer.tools.synth import build_tiny_vocab, write_tiny_model

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen2, 2 layers, n_embd 64, q/k/v biases, tied embeddings; F16/Q8_0/Q5_0/Q4_0/F32."""
    types = {"token_embd": QType.F16, "attn_v": QType.Q5_0, "ffn_down": QType.Q4_0,
             "default": QType.Q8_0}
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2.gguf", weight_types=types)


@pytest.fixture(scope="session")
def tiny_qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen3moe, 2 layers, n_embd 256, 8 experts 256 wide of which 2 per token; Q4_K / Q6_K
    experts (repacked), Q8_0 elsewhere, untied output."""
    types = {"ffn_gate": QType.Q4_K, "ffn_up": QType.Q4_K, "ffn_down": QType.Q6_K,
             "output": QType.Q6_K, "default": QType.Q8_0}
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3moe.gguf", arch="qwen3moe",
                            n_embd=256, n_ff=256, head_dim=32, n_expert=8, n_expert_used=2,
                            weight_types=types, tied=False)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen3, 2 layers, n_embd 256, head_dim 32 (≠ n_embd/n_head), q/k norms, untied output;
    K-quants (Q4_K/Q5_K/Q6_K) on the FFN, Q5_0/Q8_0 elsewhere."""
    types = {"token_embd": QType.Q8_0, "output": QType.Q6_K, "ffn_gate": QType.Q4_K,
             "ffn_up": QType.Q5_K, "ffn_down": QType.Q6_K, "attn_output": QType.Q8_0,
             "default": QType.Q5_0}
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3.gguf", arch="qwen3",
                            n_embd=256, n_ff=512, head_dim=32, weight_types=types, tied=False)


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The development model, pulled into $MINFER_HOME on first use."""
    from minfer.store import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(name, template=None): a tiny qwen3 with `<think>` / `</think>` tokens and the chat
    template tests/fixtures/templates/<name>.jinja (or the given text), made once per name."""
    made: dict[str, Path] = {}

    def make(name: str, template: str | None = None) -> Path:
        if name not in made:
            text = template if template is not None else (TEMPLATES / f"{name}.jinja").read_text()
            made[name] = write_tiny_model(
                tmp_path_factory.mktemp("think") / f"{name}.gguf", arch="qwen3", n_embd=64,
                n_ff=128, head_dim=16, chat_template=text,
                vocab=build_tiny_vocab(extra_tokens=("<think>", "</think>")))
        return made[name]

    return make
