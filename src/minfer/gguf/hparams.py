"""Hyper-parameters of a supported model, read from GGUF metadata and checked against its tensors.

Owns the mapping `<arch>.*` keys → `HParams`, the list of supported architectures, and the
validation that every tensor the forward pass needs exists with the shape the hyper-parameters
imply. Missing keys and bad shapes are `GGUFError`s; an architecture minfer cannot run is a
`ModelError` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from minfer.errors import GGUFError, ModelError
from minfer.gguf.reader import GGUFFile

SUPPORTED_ARCHS = ("qwen2", "qwen3")
DEFAULT_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class HParams:
    """What the forward pass needs to know about a model (sizes, norms, rope, layout flags)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    tie_embeddings: bool
    has_qkv_bias: bool
    has_qk_norm: bool

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> HParams:
        arch = f.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f.path, "missing metadata key 'general.architecture'")
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(f"{f.path}: architecture {arch!r} is not supported "
                             f"(minfer runs {', '.join(SUPPORTED_ARCHS)})")
        keys = _Keys(f, arch)
        n_embd = keys.get_int("embedding_length")
        n_head = keys.get_int("attention.head_count")
        n_head_kv = keys.get_int("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise GGUFError(f.path, f"head_count={n_head} is not a multiple of "
                                    f"head_count_kv={n_head_kv}")
        if "attention.key_length" not in keys and n_embd % n_head:
            raise GGUFError(f.path, f"embedding_length={n_embd} is not a multiple of "
                                    f"head_count={n_head} and key_length is missing")
        head_dim = keys.get_int("attention.key_length", n_embd // n_head)
        if keys.get_int("attention.value_length", head_dim) != head_dim:
            raise GGUFError(f.path, "attention.value_length differs from key_length")
        rope_dim = keys.get_int("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise GGUFError(f.path, f"rope.dimension_count={rope_dim} does not fit "
                                    f"head_dim={head_dim}")
        embd = f.tensors.get("token_embd.weight")
        if embd is None or len(embd.shape) != 2:
            raise GGUFError(f.path, "missing 2-D tensor 'token_embd.weight'")
        hp = cls(
            arch=arch,
            n_layer=keys.get_int("block_count"),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=keys.get_int("feed_forward_length"),
            n_vocab=embd.shape[1],
            n_ctx_train=keys.get_int("context_length"),
            rms_eps=keys.get_float("attention.layer_norm_rms_epsilon"),
            rope_base=keys.get_float("rope.freq_base", DEFAULT_ROPE_BASE),
            rope_dim=rope_dim,
            tie_embeddings="output.weight" not in f.tensors,
            has_qkv_bias="blk.0.attn_q.bias" in f.tensors,
            has_qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        )
        hp.check_tensors(f)
        return hp

    def expected_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, GGUF ne shape) of every tensor the forward pass reads."""
        q_dim = self.n_head * self.head_dim
        kv_dim = self.n_head_kv * self.head_dim
        yield "token_embd.weight", (self.n_embd, self.n_vocab)
        yield "output_norm.weight", (self.n_embd,)
        if not self.tie_embeddings:
            yield "output.weight", (self.n_embd, self.n_vocab)
        for i in range(self.n_layer):
            blk = f"blk.{i}"
            yield f"{blk}.attn_norm.weight", (self.n_embd,)
            yield f"{blk}.attn_q.weight", (self.n_embd, q_dim)
            yield f"{blk}.attn_k.weight", (self.n_embd, kv_dim)
            yield f"{blk}.attn_v.weight", (self.n_embd, kv_dim)
            if self.has_qkv_bias:
                yield f"{blk}.attn_q.bias", (q_dim,)
                yield f"{blk}.attn_k.bias", (kv_dim,)
                yield f"{blk}.attn_v.bias", (kv_dim,)
            if self.has_qk_norm:
                yield f"{blk}.attn_q_norm.weight", (self.head_dim,)
                yield f"{blk}.attn_k_norm.weight", (self.head_dim,)
            yield f"{blk}.attn_output.weight", (q_dim, self.n_embd)
            yield f"{blk}.ffn_norm.weight", (self.n_embd,)
            yield f"{blk}.ffn_gate.weight", (self.n_embd, self.n_ff)
            yield f"{blk}.ffn_up.weight", (self.n_embd, self.n_ff)
            yield f"{blk}.ffn_down.weight", (self.n_ff, self.n_embd)

    def check_tensors(self, f: GGUFFile) -> None:
        """Raise GGUFError naming the first required tensor that is missing or misshapen."""
        for name, shape in self.expected_shapes():
            t = f.tensors.get(name)
            if t is None:
                raise GGUFError(f.path, f"missing tensor {name!r}")
            if t.shape != shape:
                raise GGUFError(f.path, f"tensor {name!r} has shape {list(t.shape)}, "
                                        f"expected {list(shape)}")


class _Keys:
    """Typed access to `<arch>.<key>` metadata with defaults; wrong or missing → GGUFError."""

    def __init__(self, f: GGUFFile, arch: str) -> None:
        self.f = f
        self.arch = arch

    def __contains__(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.f.metadata

    def _get(self, key: str, default: Any) -> Any:
        full = f"{self.arch}.{key}"
        value = self.f.metadata.get(full, default)
        if value is None:
            raise GGUFError(self.f.path, f"missing metadata key {full!r}")
        return value

    def get_int(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(self.f.path, f"{self.arch}.{key}={value!r} is not a positive integer")
        return value

    def get_float(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or not 0 < value < math.inf:
            raise GGUFError(self.f.path, f"{self.arch}.{key}={value!r} is not a positive number")
        return float(value)
