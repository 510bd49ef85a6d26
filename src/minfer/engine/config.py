"""`EngineConfig`: what configures an Engine, with the one set of defaults every surface uses.

`minfer run` / `chat` / `bench` (through `minfer.load`), the Python API and `minfer serve` build
their engines' configs with `EngineConfig.build` from their flags or arguments and the
environment (`minfer.env`), so a default is the same wherever an engine is made. Fields:

- n_ctx: the context (KV cells) the engine holds;
- k_type / v_type: the KV cache formats (f32, f16, q8_0, q4_0; the backend that owns them
  refuses the rest);
- fuse_swiglu: the SwiGLU / GeGLU activation fused into one node (on); fuse_gate_up: a decode
  graph's gate and up projections and their SwiGLU as one node, and on CPU-only graphs one
  split step of the op tape that also quantizes the result for the down projection
  (`kernels.linear.gate_up`: two serial steps and two barriers a layer fewer; on);
  fuse_add_norm: a residual add and the RMSNorm
  reading it as one node, one step of the op tape (CPU-only graphs, on); fuse_norm_quant: that
  norm's step also quantizes its rows for the projections reading them (CPU-only graphs, on);
  fuse_bias: a projection's bias added by its kernel, no step of its own (CPU-only graphs, on);
  fuse_rope_store: rope of q and k in the KV store's step, k roped straight into the cache
  (CPU-only graphs, on); fuse_attn_quant: attention's step also quantizes each KV head's
  query heads for the output projection (CPU-only graphs, on);
- n_threads: threads for prefill and the most a decode step may take; adaptive_threads: decode
  steps pick their count by measurement (when the user gave none);
- batch_invariant: every row's arithmetic independent of the batch around it (the server);
- batched: the weights take the layouts fastest for many rows (`ExecContext.batched`); None:
  as batch_invariant (the server's steps carry many rows, a lone run's decode one);
- vocab_limit: score only the first N token ids (a draft model's head);
- state_checkpoints: per sequence, how many copies of a recurrent model's state (LFM2) the
  engine keeps at chunk boundaries and prompt ends, to reuse a prefix of its cells
  (`minfer.backends.checkpoints`; 0: none, only a prompt extending everything reuses);
- pooling: None for the model's own output (a decoder's logits, an encoder's embeddings pooled
  as its file says); "none" / "mean" / "cls" / "last" / "rank" for embeddings pooled so (a
  decoder then returns its final hidden states, `--embeddings --pooling`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from minfer import env


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int = 4096
    k_type: str = "f16"
    v_type: str = "f16"
    fuse_swiglu: bool = True
    fuse_gate_up: bool = True
    fuse_add_norm: bool = True
    fuse_norm_quant: bool = True
    fuse_bias: bool = True
    fuse_rope_store: bool = True
    fuse_attn_quant: bool = True
    n_threads: int | None = None
    adaptive_threads: bool = False
    batch_invariant: bool = False
    batched: bool | None = None
    vocab_limit: int = 0
    pooling: str | None = None
    state_checkpoints: int = 4

    @classmethod
    def build(cls, *, n_ctx: int = 4096, kv_type: str = "f16", k_type: str | None = None,
              v_type: str | None = None, threads: int | None = None, fuse: bool = True,
              batch_invariant: bool = False, state_checkpoints: int = 4) -> EngineConfig:
        """A surface's config from its options: `kv_type` sets both caches unless k_type /
        v_type say otherwise; without `threads` (nor MINFER_THREADS) every usable core, with
        decode steps picking their count by measurement."""
        chosen = threads or env.threads()
        return cls(n_ctx=n_ctx, k_type=k_type or kv_type, v_type=v_type or kv_type,
                   fuse_swiglu=fuse, fuse_gate_up=fuse, fuse_add_norm=fuse,
                   fuse_norm_quant=fuse,
                   fuse_bias=fuse, fuse_rope_store=fuse, fuse_attn_quant=fuse,
                   n_threads=chosen or usable_cores(),
                   adaptive_threads=chosen is None, batch_invariant=batch_invariant,
                   state_checkpoints=state_checkpoints)


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
