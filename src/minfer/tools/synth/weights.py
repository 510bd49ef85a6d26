"""Random weights for the synthetic models: normal(0, std) matrices in any type minfer writes.

Block formats need the row length (n_embd for most matrices, n_ff for ffn_down, n_head*head_dim
for attn_output) to be a multiple of the block size: 32 for Q4_0…Q8_0 and MXFP4, 256 for the
K-quants. `Tensors` is what the newer writers (qwen35, gpt-oss) add their tensors through, in
one type per role or in a llama-quantize file type's mix (`mixed_types`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.tools.quantize.mix import FType, ModelShape
from minfer.tools.quantize.simple import can_quantize, quantize

ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
         "ffn_gate", "ffn_up", "ffn_down")
WeightTypes = QType | Mapping[str, QType]  # one type, or role → type ("default" for the rest)


def type_for(weight_types: WeightTypes, role: str) -> QType:
    if isinstance(weight_types, QType):
        return weight_types
    return QType(weight_types.get(role, weight_types.get("default", QType.F32)))


def random_matrix(rng: np.random.Generator, n_out: int, n_in: int, *, std: float,
                   qtype: QType, name: str) -> tuple[np.ndarray, QType | None]:
    """A [n_out, n_in] normal(0, std) weight in qtype, built in row chunks to bound memory."""
    if not can_quantize(qtype, n_in):
        raise ValueError(f"{name}: rows of {n_in} values cannot be {qtype.name} "
                         "(block formats need multiples of 32, K-quants of 256)")
    chunks = []
    for start in range(0, n_out, 8192):
        rows = min(8192, n_out - start)
        chunks.append(quantize(rng.standard_normal((rows, n_in), dtype=np.float32) * std, qtype))
    raw_dtype = None if qtype in (QType.F32, QType.F16) else qtype
    return np.concatenate(chunks), raw_dtype


# A tensor's type from its name and role (a writer's `weight_types` resolved).
TypeOf = Callable[[str, str], QType]


class Tensors:
    """Adds a writer's tensors: matrices and stacked experts of random weights, each in the type
    `type_of(name, role)` gives, and F32 vectors. With `w` None it only records each quantizable
    tensor's (name, ne shape), so a file type's mix can be chosen before the real pass."""

    def __init__(self, w: gguf.GGUFWriter | None, rng: np.random.Generator,
                 type_of: TypeOf) -> None:
        self.w, self.rng, self.type_of = w, rng, type_of
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def matrix(self, name: str, role: str, n_out: int, n_in: int, *, std: float) -> None:
        self.experts(name, role, 1, n_out, n_in, std=std)

    def experts(self, name: str, role: str, n_exp: int, n_out: int, n_in: int, *,
                std: float) -> None:
        """[n_exp, n_out, n_in] weights (ne [n_in, n_out, n_exp]); one expert: a matrix."""
        shape = (n_in, n_out) if n_exp == 1 else (n_in, n_out, n_exp)
        self.shapes.append((name, shape))
        if self.w is None:
            return
        data, raw = random_matrix(self.rng, n_exp * n_out, n_in, std=std,
                                  qtype=self.type_of(name, role), name=name)
        self.w.add_tensor(name, data if n_exp == 1 else data.reshape(n_exp, n_out, -1),
                          raw_dtype=raw)

    def vector(self, name: str, n: int | tuple[int, int], *, mean: float, std: float) -> None:
        """F32 values normal(mean, std): n of them, or (rows, n) for a per-expert bias."""
        self.shapes.append((name, (n,) if isinstance(n, int) else n[::-1]))
        if self.w is not None:
            self.w.add_tensor(name, (mean + std * self.rng.standard_normal(n)).astype(np.float32))


def mixed_types(body: Callable[[Tensors], None], model: ModelShape,
                weight_types: WeightTypes | FType) -> TypeOf:
    """`type_of` for a writer: by role from WeightTypes, or by name as llama-quantize's mix of
    the file type chooses (its rules run on the tensors `body` records)."""
    if not isinstance(weight_types, FType):
        return lambda name, role: type_for(weight_types, role)
    from minfer.tools.quantize.mix import MixOptions, choose_types, tensor_order

    dry = Tensors(None, np.random.default_rng(0), lambda name, role: QType.F32)
    body(dry)
    names = tensor_order([name for name, _ in dry.shapes])
    shapes = dict(dry.shapes)
    chosen = choose_types([(n, shapes[n], QType.F32) for n in names], model,
                          MixOptions(weight_types))
    return lambda name, role: chosen[name]


def begin(path: Path, arch: str, *, n_layer: int, n_embd: int, n_ff: int, n_head: int,
          n_head_kv: int, head_dim: int, n_ctx_train: int, rope_base: float,
          eps: float) -> gguf.GGUFWriter:
    """A writer with the keys every decoder has (the architecture's own come after)."""
    w = gguf.GGUFWriter(path, arch, use_temp_file=True)
    w.add_name(f"synthetic-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(eps)
    return w


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
