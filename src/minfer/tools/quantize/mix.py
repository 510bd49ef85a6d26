"""Which type each tensor gets: llama.cpp's file types (Q4_K_M, Q5_K_S, …) and its per-tensor rules.

A port of src/llama-quant.cpp (`tensor_allows_quantization`, `llama_tensor_get_type`,
`llama_tensor_get_type_impl`, `tensor_type_fallback`) for the file types minfer writes, so a
mix puts the same tensors at higher precision as llama-quantize does: output.weight (or the
tied token_embd) at Q6_K, attn_v and ffn_down at Q6_K on the layers `use_more_bits` picks in
Q4_K_M / Q5_K_M, the first layers' ffn_down at Q5_K in Q4_K_S, … Counters run in llama.cpp's
tensor order (`tensor_order`: non-block tensors first, then by layer, names byte-wise), which
matters because attn_v's rule counts attn_v tensors rather than reading the layer number.
Rows that are not a whole number of blocks fall back (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0,
Q2_K/Q3_K → Q4_0, the 256-block i-quants → IQ4_NL, then F16). The i-quant mixes (IQ1_S/M,
IQ2_XXS/XS/S/M, IQ3_XXS/XS/S/M) follow llama.cpp's rules (the very-low-bit ones: output at
Q5_K, attn_v and the first eighth of ffn_down at Q2_K or IQ3_S, token_embd at Q2_K / IQ3_S;
IQ3_XXS attn_q / attn_k at IQ2_S and attn_output at IQ3_S; IQ3_XS attn_q / attn_k and the
middle layers' ffn_gate / ffn_up at IQ3_XXS; IQ3_M attn_v, attn_output and the first eighth
of ffn_down at Q4_K) and their lowest-bit tensors need an importance vector
(`requires_imatrix`) as llama-quantize demands. Q2_K_S is refused.
`--tensor-type PATTERN=TYPE` overrides (`tensor_types`) are searched in order in each
quantizable tensor's name (a regular expression, the first match wins) before the mix's rules,
which then do not run for it (nor count it); the fallback still applies. With an importance
matrix (`imatrix`), Q4_0 / Q5_0 put the first eighth of ffn_down at Q4_1 / Q5_1 and IQ4_NL /
IQ4_XS keep those at their type (Q5_K without one), as llama.cpp does. MXFP4_MOE (gpt-oss's
mix) puts stacked expert tensors at MXFP4 and every other quantizable tensor, output included,
at Q8_0; no counter advances under it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .rows import SUPPORTED, QuantizeError

QT = GGMLQuantizationType


class FType(IntEnum):
    """llama_ftype values (written as general.file_type)."""

    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q4_1 = 3
    MOSTLY_Q8_0 = 7
    MOSTLY_Q5_0 = 8
    MOSTLY_Q5_1 = 9
    MOSTLY_Q2_K = 10
    MOSTLY_Q3_K_S = 11
    MOSTLY_Q3_K_M = 12
    MOSTLY_Q3_K_L = 13
    MOSTLY_Q4_K_S = 14
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q5_K_S = 16
    MOSTLY_Q5_K_M = 17
    MOSTLY_Q6_K = 18
    MOSTLY_IQ2_XXS = 19
    MOSTLY_IQ2_XS = 20
    MOSTLY_IQ3_XS = 22
    MOSTLY_IQ3_XXS = 23
    MOSTLY_IQ1_S = 24
    MOSTLY_IQ4_NL = 25
    MOSTLY_IQ3_S = 26
    MOSTLY_IQ3_M = 27
    MOSTLY_IQ2_S = 28
    MOSTLY_IQ2_M = 29
    MOSTLY_IQ4_XS = 30
    MOSTLY_IQ1_M = 31
    MOSTLY_BF16 = 32
    MOSTLY_MXFP4_MOE = 38


# llama-quantize's names (Q3_K, Q4_K, Q5_K are its aliases of the _M mixes) → file type.
FTYPE_NAMES: dict[str, FType] = {
    "F32": FType.ALL_F32, "F16": FType.MOSTLY_F16, "BF16": FType.MOSTLY_BF16,
    "Q4_0": FType.MOSTLY_Q4_0, "Q4_1": FType.MOSTLY_Q4_1, "Q5_0": FType.MOSTLY_Q5_0,
    "Q5_1": FType.MOSTLY_Q5_1, "Q8_0": FType.MOSTLY_Q8_0, "Q2_K": FType.MOSTLY_Q2_K,
    "Q3_K": FType.MOSTLY_Q3_K_M, "Q3_K_S": FType.MOSTLY_Q3_K_S, "Q3_K_M": FType.MOSTLY_Q3_K_M,
    "Q3_K_L": FType.MOSTLY_Q3_K_L, "Q4_K": FType.MOSTLY_Q4_K_M, "Q4_K_S": FType.MOSTLY_Q4_K_S,
    "Q4_K_M": FType.MOSTLY_Q4_K_M, "Q5_K": FType.MOSTLY_Q5_K_M, "Q5_K_S": FType.MOSTLY_Q5_K_S,
    "Q5_K_M": FType.MOSTLY_Q5_K_M, "Q6_K": FType.MOSTLY_Q6_K, "IQ4_NL": FType.MOSTLY_IQ4_NL,
    "IQ4_XS": FType.MOSTLY_IQ4_XS, "IQ2_XXS": FType.MOSTLY_IQ2_XXS,
    "IQ3_XXS": FType.MOSTLY_IQ3_XXS, "IQ2_XS": FType.MOSTLY_IQ2_XS,
    "IQ2_S": FType.MOSTLY_IQ2_S, "IQ2_M": FType.MOSTLY_IQ2_M, "IQ1_S": FType.MOSTLY_IQ1_S,
    "IQ1_M": FType.MOSTLY_IQ1_M, "IQ3_XS": FType.MOSTLY_IQ3_XS, "IQ3_S": FType.MOSTLY_IQ3_S,
    "IQ3_M": FType.MOSTLY_IQ3_M, "MXFP4_MOE": FType.MOSTLY_MXFP4_MOE,
}

DEFAULT_TYPE: dict[FType, QT] = {
    FType.ALL_F32: QT.F32, FType.MOSTLY_F16: QT.F16, FType.MOSTLY_BF16: QT.BF16,
    FType.MOSTLY_Q4_0: QT.Q4_0, FType.MOSTLY_Q4_1: QT.Q4_1, FType.MOSTLY_Q5_0: QT.Q5_0,
    FType.MOSTLY_Q5_1: QT.Q5_1, FType.MOSTLY_Q8_0: QT.Q8_0, FType.MOSTLY_Q2_K: QT.Q2_K,
    FType.MOSTLY_Q3_K_S: QT.Q3_K, FType.MOSTLY_Q3_K_M: QT.Q3_K, FType.MOSTLY_Q3_K_L: QT.Q3_K,
    FType.MOSTLY_Q4_K_S: QT.Q4_K, FType.MOSTLY_Q4_K_M: QT.Q4_K, FType.MOSTLY_Q5_K_S: QT.Q5_K,
    FType.MOSTLY_Q5_K_M: QT.Q5_K, FType.MOSTLY_Q6_K: QT.Q6_K, FType.MOSTLY_IQ4_NL: QT.IQ4_NL,
    FType.MOSTLY_IQ4_XS: QT.IQ4_XS, FType.MOSTLY_IQ2_XXS: QT.IQ2_XXS,
    FType.MOSTLY_IQ3_XXS: QT.IQ3_XXS, FType.MOSTLY_MXFP4_MOE: QT.MXFP4,
    FType.MOSTLY_IQ2_XS: QT.IQ2_XS, FType.MOSTLY_IQ2_S: QT.IQ2_XS, FType.MOSTLY_IQ2_M: QT.IQ2_S,
    FType.MOSTLY_IQ1_S: QT.IQ1_S, FType.MOSTLY_IQ1_M: QT.IQ1_M, FType.MOSTLY_IQ3_XS: QT.IQ3_S,
    FType.MOSTLY_IQ3_S: QT.IQ3_S, FType.MOSTLY_IQ3_M: QT.IQ3_S,
}

_FLOATS = frozenset({QT.F32, QT.F16, QT.BF16})
_FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1,
             QT.Q6_K: QT.Q8_0, **{t: QT.IQ4_NL for t in (QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS,
                                                         QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS,
                                                         QT.IQ3_S, QT.IQ4_XS)}}
# Types llama-quantize refuses to write without an importance vector (tensor_requires_imatrix;
# token_embd and output are exempt).
_NEED_IMATRIX = frozenset({QT.IQ3_XXS, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_M, QT.IQ1_S})
# llama.cpp's very-low-bit file types (its output rule puts output.weight at Q5_K for them),
# and those of its own branch for attn_v / ffn_down / attn_output (`_Chooser._iq2`).
_VERY_LOW = frozenset({FType.MOSTLY_IQ2_XXS, FType.MOSTLY_IQ2_XS, FType.MOSTLY_IQ1_S,
                       FType.MOSTLY_IQ2_S, FType.MOSTLY_IQ2_M, FType.MOSTLY_IQ1_M})
_LOW_BIT = _VERY_LOW | {FType.MOSTLY_IQ3_XXS}
_IQ2_SM = frozenset({FType.MOSTLY_IQ2_S, FType.MOSTLY_IQ2_M})  # their Q2_K is IQ3_S

# Substrings of tensor names llama.cpp never quantizes (besides norms and 1-D tensors).
_KEEP_SUBSTRINGS = (
    "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    *(f"time_mix_{k}.weight" for k in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1",
                                       "a2", "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")),
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos",
    ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
_KEEP_NAMES = frozenset({"position_embd.weight", "token_types.weight"})
_LAYER_RE = re.compile(r"blk\.([+-]?\d+)")


def parse_ftype(name: str) -> FType:
    key = name.upper()
    if key in FTYPE_NAMES:
        return FTYPE_NAMES[key]
    hint = " (it needs an importance matrix)" if key.startswith(("IQ", "Q2_K_S")) else ""
    raise QuantizeError(f"unknown or unsupported quantization type {name!r}{hint}; choose one "
                        f"of {', '.join(FTYPE_NAMES)}")


def parse_tensor_type(name: str) -> QT:
    """A GGML tensor type name (for --output-tensor-type / --token-embedding-type)."""
    qtype = QT.__members__.get(name.upper())
    if qtype is None or qtype not in SUPPORTED:
        raise QuantizeError(f"unsupported tensor type {name!r}; choose one of "
                            f"{', '.join(t.name for t in sorted(SUPPORTED))}")
    return qtype


def tensor_order(names: Sequence[str]) -> list[str]:
    """llama.cpp's weights_map order: layer number (-1 outside blocks) then bytes of the name."""
    def key(name: str) -> tuple[int, bytes]:
        m = _LAYER_RE.match(name)
        return (int(m.group(1)) if m else -1, name.encode())
    return sorted(names, key=key)


def n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    if n_dims(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return False
    return name not in _KEEP_NAMES and not any(s in name for s in _KEEP_SUBSTRINGS)


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for cat in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight",
                "attn_q.weight", "attn_output.weight"):
        if cat in name:
            return cat.removesuffix(".weight")
    for cat in ("ffn_up", "ffn_gate", "ffn_down"):
        if cat in name:
            return cat
    return "other"


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


@dataclass(frozen=True)
class ModelShape:
    """What the rules read from the model: arch, layers, heads, experts."""

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv


@dataclass(frozen=True)
class MixOptions:
    ftype: FType
    pure: bool = False
    output_tensor_type: QT | None = None
    token_embedding_type: QT | None = None
    tensor_types: tuple[tuple[str, QT], ...] = ()  # (pattern, type), llama.cpp's tt_overrides
    imatrix: bool = False  # an importance matrix is given (has_imatrix)


def parse_tensor_type_override(text: str) -> tuple[str, QT]:
    """`--tensor-type NAME=TYPE` as llama-quantize parses it: the name lowercased (a regular
    expression searched in tensor names), TYPE a ggml type name."""
    name, sep, qtype = text.partition("=")
    if not sep:
        raise QuantizeError(f"malformed tensor type {text!r} (expected PATTERN=TYPE)")
    if not name:
        raise QuantizeError("missing tensor name in --tensor-type")
    if not qtype:
        raise QuantizeError("missing quantization type in --tensor-type")
    try:
        re.compile(name.lower())
    except re.error as exc:
        raise QuantizeError(f"--tensor-type {text!r}: bad pattern ({exc})") from None
    return name.lower(), parse_tensor_type(qtype)


class _Chooser:
    """llama_tensor_get_type_impl with its counters (one instance per file)."""

    def __init__(self, model: ModelShape, opts: MixOptions, names: Sequence[str]) -> None:
        self.m = model
        self.o = opts
        cats = [category(n) for n in names]
        self.n_attention_wv = sum(c in ("attn_v", "attn_qkv", "attn_kv_b") for c in cats)
        self.tied = "output" not in cats
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0

    def _layer(self, counter: int, name: str) -> tuple[int, int]:
        if self.m.n_expert > 1:
            m = re.match(r"blk\.(\d+)\.", name)
            if not m or not 0 <= int(m.group(1)) < self.m.n_layer:
                raise QuantizeError(f"cannot tell the layer of tensor {name!r}")
            return int(m.group(1)), self.m.n_layer
        return counter, self.m.n_layer

    def impl(self, new: QT, name: str, shape: Sequence[int], cat: str) -> QT:
        ft, F, m = self.o.ftype, FType, self.m
        falcon = m.arch == "falcon"
        if cat == "output" or (self.tied and cat == "token_embd"):
            if self.o.output_tensor_type is not None:
                return self.o.output_tensor_type
            if ft == F.MOSTLY_MXFP4_MOE or falcon or shape[0] % GGML_QUANT_SIZES[new][0]:
                return QT.Q8_0
            if ft in _LOW_BIT:
                return QT.Q5_K
            return new if new == QT.Q8_0 else QT.Q6_K
        if ft == F.MOSTLY_MXFP4_MOE:  # stacked experts (ne2 > 1) MXFP4, every other Q8_0
            return QT.MXFP4 if len(shape) > 2 and shape[2] > 1 else QT.Q8_0
        if cat == "token_embd":
            if self.o.token_embedding_type is not None:
                return self.o.token_embedding_type
            if ft in _VERY_LOW:
                return QT.IQ3_S if ft in _IQ2_SM else QT.Q2_K
            return QT.IQ3_S if ft == F.MOSTLY_IQ3_XXS else new
        if ft in _VERY_LOW:
            return self._iq2(new, cat)
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):  # (llama.cpp's own attn_qkv rule is
            # unreachable: this branch catches attn_qkv first)
            i, n = self.i_attention_wv, self.n_attention_wv
            if ft == F.MOSTLY_Q2_K:
                new = QT.Q4_K if m.n_gqa >= 4 else QT.Q3_K
            elif ft == F.MOSTLY_IQ3_XXS:
                new = (QT.Q4_K if m.n_gqa >= 4 else QT.IQ3_XXS if self.o.imatrix else
                       QT.IQ3_S)
            elif ft == F.MOSTLY_IQ3_M or (ft in (F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S)
                                          and m.n_gqa >= 4):
                new = QT.Q4_K
            elif ft == F.MOSTLY_Q3_K_M:
                new = QT.Q5_K if i < 2 else QT.Q4_K
            elif ft == F.MOSTLY_Q3_K_L or (ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS)
                                           and m.n_gqa >= 4):
                new = QT.Q5_K
            elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _use_more_bits(i, n):
                new = QT.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and i < 4:
                new = QT.Q5_K
            if m.is_70b and new in (QT.Q3_K, QT.Q4_K):
                new = QT.Q5_K
            if m.n_expert == 8:
                new = QT.Q8_0
            self.i_attention_wv += 1
        elif cat == "attn_k":
            if m.n_expert == 8:
                new = QT.Q8_0
            elif ft == F.MOSTLY_IQ3_XS:
                new = QT.IQ3_XXS
            elif ft == F.MOSTLY_IQ3_XXS:
                new = QT.IQ2_S
        elif cat == "attn_q":
            if ft == F.MOSTLY_IQ3_XS:
                new = QT.IQ3_XXS
            elif ft == F.MOSTLY_IQ3_XXS:
                new = QT.IQ2_S
        elif cat == "ffn_down":
            i, n = self._layer(self.i_ffn_down, name)
            if ft == F.MOSTLY_Q2_K:
                new = QT.Q3_K
            elif ft == F.MOSTLY_IQ3_XXS and not self.o.imatrix:
                new = QT.Q4_K if i < n // 8 else QT.Q3_K
            elif ft == F.MOSTLY_Q3_K_M:
                new = (QT.Q5_K if i < n // 16 else
                       QT.Q4_K if not falcon or _use_more_bits(i, n) else QT.Q3_K)
            elif ft == F.MOSTLY_IQ3_M and (i < n // 8 or (m.n_expert == 8
                                                          and _use_more_bits(i, n))):
                new = QT.Q4_K
            elif ft == F.MOSTLY_Q3_K_L:
                new = QT.Q4_K if falcon else QT.Q5_K
            elif ft == F.MOSTLY_Q4_K_M:
                if falcon:
                    new = (QT.Q6_K if i < n // 16 else
                           QT.Q5_K if _use_more_bits(i, n) else QT.Q4_K)
                elif _use_more_bits(i, n):
                    new = QT.Q6_K
            elif (i < n // 8 and ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS)
                  and not self.o.imatrix):
                new = QT.Q5_K
            elif ft == F.MOSTLY_Q5_K_M and _use_more_bits(i, n):
                new = QT.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and not falcon and i < n // 8:
                new = QT.Q5_K
            elif ft in (F.MOSTLY_Q4_0, F.MOSTLY_Q5_0) and self.o.imatrix and i < n // 8:
                new = QT.Q4_1 if ft == F.MOSTLY_Q4_0 else QT.Q5_1
            self.i_ffn_down += 1
        elif cat == "attn_output":
            if not falcon:
                if m.n_expert == 8:
                    if ft in (F.MOSTLY_Q2_K, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_Q4_K_S,
                              F.MOSTLY_Q4_K_M, F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS,
                              F.MOSTLY_IQ3_XXS, F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S,
                              F.MOSTLY_IQ3_M):
                        new = QT.Q5_K
                else:
                    new = {F.MOSTLY_Q2_K: QT.Q3_K, F.MOSTLY_Q3_K_M: QT.Q4_K,
                           F.MOSTLY_Q3_K_L: QT.Q5_K, F.MOSTLY_IQ3_XXS: QT.IQ3_S,
                           F.MOSTLY_IQ3_M: QT.Q4_K}.get(ft, new)
            elif ft == F.MOSTLY_Q3_K_L:
                new = QT.Q4_K
        elif cat in ("ffn_gate", "ffn_up"):
            i, n = self._layer(self.i_ffn_gate if cat == "ffn_gate" else self.i_ffn_up, name)
            if ft == F.MOSTLY_IQ3_XS and n // 8 <= i < 7 * n // 8:
                new = QT.IQ3_XXS
            if cat == "ffn_gate":
                self.i_ffn_gate += 1
            else:
                self.i_ffn_up += 1
        return new

    def _iq2(self, new: QT, cat: str) -> QT:
        """llama.cpp's very-low-bit branch (IQ1_S/M, IQ2_XXS/XS/S/M): attn_v at Q2_K (IQ3_S
        in IQ2_S/M; Q4_K with GQA of 4 or more, or 4+ experts), the first eighth of ffn_down
        at Q2_K (IQ3_S in IQ2_S/M), attn_output at IQ2_XXS in IQ1_S/M and IQ3_S in IQ2_S/M,
        attn_k of 8-expert models and their attn_output at Q4_K / Q5_K; no other counters
        move."""
        m, ft = self.m, self.o.ftype
        low = QT.IQ3_S if ft in _IQ2_SM else QT.Q2_K
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            new = QT.Q4_K if m.n_gqa >= 4 or m.n_expert >= 4 else low
            self.i_attention_wv += 1
        elif m.n_expert == 8 and cat == "attn_k":
            new = QT.Q4_K
        elif cat == "ffn_down":
            if self.i_ffn_down < m.n_layer // 8:
                new = low
            self.i_ffn_down += 1
        elif cat == "attn_output":
            if m.n_expert == 8:
                new = QT.Q5_K
            elif ft in (FType.MOSTLY_IQ1_S, FType.MOSTLY_IQ1_M):
                new = QT.IQ2_XXS
            elif ft in _IQ2_SM:
                new = QT.IQ3_S
        return new


def requires_imatrix(name: str, qtype: QT) -> bool:
    """tensor_requires_imatrix (for the file types minfer writes): the lowest-bit i-quants,
    but for token_embd and output."""
    exempt = name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")
    return qtype in _NEED_IMATRIX and not exempt


def _fallback(name: str, ne0: int, target: QT) -> QT:
    block = GGML_QUANT_SIZES[target][0]
    if ne0 % block == 0:
        return target
    new = _FALLBACK.get(target, target)
    return new if ne0 % GGML_QUANT_SIZES[new][0] == 0 else QT.F16


def choose_types(tensors: Sequence[tuple[str, tuple[int, ...], QT]], model: ModelShape,
                 opts: MixOptions) -> dict[str, QT]:
    """name → target type for (name, ne shape, current type) given in llama.cpp's order."""
    chooser = _Chooser(model, opts, [t[0] for t in tensors])
    default = DEFAULT_TYPE[opts.ftype]
    patterns = [(re.compile(p), qt) for p, qt in opts.tensor_types]

    def manual(name: str) -> QT | None:
        return next((qt for p, qt in patterns if p.search(name)), None)

    out: dict[str, QT] = {}
    for name, shape, cur in tensors:
        cat = category(name)
        if not allows_quantization(name, shape):
            new = cur
        elif (opts.token_embedding_type is not None and cat == "token_embd"
              and (name != "per_layer_token_embd.weight" or manual(name) is None)):
            new = opts.token_embedding_type
        elif opts.output_tensor_type is not None and cat == "output":
            new = opts.output_tensor_type
        elif default in _FLOATS:
            new = default
        else:
            override = manual(name)
            if override is not None:
                new = override
            else:
                new = default if opts.pure else chooser.impl(default, name, shape, cat)
            new = _fallback(name, shape[0], new)
        if shape[0] % GGML_QUANT_SIZES[new][0]:
            raise QuantizeError(f"{name}: rows of {shape[0]} values cannot be {new.name} "
                                f"(block size {GGML_QUANT_SIZES[new][0]})")
        out[name] = new
    return out
