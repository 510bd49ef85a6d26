"""GraphParams: exactly what changes the node list, and nothing else.

Token ids, positions, n_past and the KV window each query reads are input data filled before
every execution; they are deliberately absent here. Two equal GraphParams must build identical
graphs, which is what lets the cache reuse a graph by comparing params alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from minfer.errors import GraphError


class GraphType(StrEnum):
    PREFILL = "prefill"  # some rows are dropped before the output stack (tail rows)
    DECODE = "decode"  # every row produces logits (one token, or one per batched sequence)


@dataclass(frozen=True)
class ContextParams:
    """Session-wide settings fixed when the context is created."""

    n_ctx: int  # KV cells in the persistent regions (all sequences together)
    k_type: str = "f16"  # K cache format: f32, f16 (llama.cpp's default), q8_0 or q4_0
    v_type: str = "f16"  # V cache format, the same choices
    fuse_swiglu: bool = True  # Mul(Silu(gate), up) -> SwiGLU
    fuse_gate_up: bool = True  # decode: gate, up and SwiGLU in one node
    fuse_add_norm: bool = True  # RmsNorm(Add(a, b)) -> AddRmsNorm (CPU-only graphs)
    fuse_norm_quant: bool = True  # a norm's step quantizes for its projections (CPU-only)
    fuse_bias: bool = True  # a projection's bias added in its kernel (CPU-only graphs)
    fuse_rope_store: bool = True  # rope of q and k in the KV store's step (CPU-only graphs)
    fuse_attn_quant: bool = True  # attention's step quantizes for the o-proj (CPU-only)
    backends: tuple[str, ...] = ("cpu",)  # backends allowed to take nodes, in preference order
    window: str = "per_token"  # KV window inputs: kv_start/kv_end per query token
    vocab_limit: int = 0  # logits of the first ids only (a draft model's head); 0: all
    # "": the LM head's logits. Else the final hidden states (embeddings): "none" every row,
    # "mean" / "cls" / "last" one pooled row per sequence, "rank" the classifier head's scores
    pooling: str = ""

    @property
    def kv_type(self) -> str:
        """Both formats in one name: the type when K and V agree, else "K/V" (e.g. "q8_0/f16")."""
        return self.k_type if self.k_type == self.v_type else f"{self.k_type}/{self.v_type}"


@dataclass(frozen=True)
class GraphParams:
    n_tokens: int
    n_out: int
    gtype: GraphType
    ctx: ContextParams
    weights_version: int = 0
    # given embedding rows (an image's) replace token embeddings: two more inputs and a node
    embd_input: bool = False
    # a second output: every row's final normed hidden state (a target whose hidden states
    # feed an MTP head, `minfer.engine.core.mtp`)
    hidden_out: bool = False

    @classmethod
    def for_batch(
        cls, n_tokens: int, n_out: int, ctx: ContextParams, weights_version: int = 0, *,
        embd_input: bool = False, hidden_out: bool = False,
    ) -> GraphParams:
        if n_tokens < 1 or not 1 <= n_out <= n_tokens:
            raise GraphError(f"bad batch shape: n_tokens={n_tokens}, n_out={n_out}")
        gtype = GraphType.DECODE if n_out == n_tokens else GraphType.PREFILL
        return cls(n_tokens, n_out, gtype, ctx, weights_version, embd_input, hidden_out)
