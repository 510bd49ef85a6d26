"""Hyper-parameters of a supported model, read from GGUF metadata and checked against its tensors.

Owns the mapping `<arch>.*` keys → `HParams`, the list of supported architectures, and the
validation that every tensor the forward pass needs exists with the shape the hyper-parameters
imply. Missing keys and bad shapes are `GGUFError`s; an architecture minfer cannot run is a
`ModelError` naming it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from minfer.errors import GGUFError, ModelError
from minfer.gguf.reader import GGUFFile
from minfer.gguf.rope_scaling import NO_YARN, Yarn, YarnRope

log = logging.getLogger("minfer")
# every surface's default context (`-c`, `n_ctx=`): capped at a shorter model's without a warning
DEFAULT_N_CTX = 4096
SUPPORTED_ARCHS = ("bert", "gemma3", "gemma4", "gpt-oss", "lfm2", "llama", "phi3", "qwen2",
                   "qwen2moe", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3vl", "qwen3vlmoe",
                   "smollm3")
# Mixtures of experts: every block's FFN is a routed set of experts (`ffn_*_exps`), qwen2moe's
# and qwen35moe's with a shared expert behind a sigmoid gate (`ffn_*_shexp`); the top-k routing
# weights are renormalised to sum to 1 where llama.cpp does it (qwen3moe, qwen35moe, llama)
# unless the file says otherwise. A llama file with `llama.expert_count` is one (Mixtral, as
# llama.cpp's converter writes it: experts as wide as `feed_forward_length`). gpt-oss routes
# on the biased router logits' top k, soft-maxed among themselves (`moe_gating`
# "softmax_weight"), through experts with biases and the clamped SwiGLU (`moe_act`
# "swiglu_oai").
MOE_ARCHS = ("gpt-oss", "qwen2moe", "qwen35moe", "qwen3moe", "qwen3vlmoe")
_MOE_NORM_DEFAULT = {"gpt-oss": False, "qwen2moe": False, "qwen35moe": True, "qwen3moe": True,
                     "qwen3vlmoe": True,
                     "llama": True}
# Archs whose MoE blocks may carry a shared expert (`blk.0.ffn_gate_inp_shexp` says they do)
_SHEXP_ARCHS = ("qwen2moe", "qwen35moe")
# Qwen3.5's trunk (Gated DeltaNet and gated attention), dense or with MoE FFNs
# Qwen3-VL's text model: Qwen3 with interleaved M-RoPE (`rope.dimension_sections`: t / h / w
# positions per pair) and deepstack (`n_deepstack_layers`: an image's rows carry that many more
# n_embd-wide blocks, block k added to layer k - 1's output); `qwen3vlmoe` with Qwen3-MoE's FFNs
MROPE_ARCHS = ("qwen3vl", "qwen3vlmoe")
QWEN35_ARCHS = ("qwen35", "qwen35moe")
# `{arch}.pooling_type` values (llama.cpp's llama_pooling_type) by name
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")
# Encoders: bidirectional attention without a KV cache, LayerNorm, learned positions
ENCODER_ARCHS = ("bert",)
DEFAULT_ROPE_BASE = 10000.0
# Gemma 3: every 6th layer attends globally, the others through a sliding window, with their
# own rope base (llama.cpp's defaults when the file names neither).
GEMMA3_SWA_PATTERN = 6
# gpt-oss: every other layer (the even ones) attends through the sliding window, at the global
# layers' rope base and scaling unless the file names a base of its own (llama.cpp's
# `llama_model_openai_moe`).
GPTOSS_SWA_PATTERN = 2
DEFAULT_ROPE_BASE_SWA = 10000.0
# Gemma 3's sandwich norms (post-attention, post-FFN); Gemma 4 has them too.
SANDWICH_ARCHS = ("gemma3", "gemma4")
# Architectures that rotate adjacent pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM); the rest NEOX.
NORM_ROPE_ARCHS = ("llama", "smollm3")
# SmolLM3: every 4th layer attends without RoPE (llama.cpp fixes n_no_rope_layer_step at 4 and
# reads no key for it; transformers' default `no_rope_layer_interval`).
NO_ROPE_STEP = {"smollm3": 4}
# Phi-3 / Phi-4-mini: `ffn_up` holds the gate and up projections ([gate | up], 2 n_ff wide),
# and LongRoPE's `rope_factors_long` / `rope_factors_short` tensors are read where present.
GATE_UP_ARCHS = ("phi3",)
LONGROPE_ARCHS = ("phi3",)
# llama.cpp pads the context to a multiple of 256 cells before choosing LongRoPE's factors
LONGROPE_CTX_PAD = 256
# Hybrids whose layers are recurrent where `attention.head_count_kv` (an array, one entry per
# layer) is 0, as llama.cpp's `llama_model_lfm2` decides: LFM2's gated short convolutions
# (`shortconv.l_cache` taps) between GQA attention layers.
RECURRENT_ARCHS = ("lfm2",)


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
    rms_eps: float  # the epsilon of the model's norms (RMSNorm; LayerNorm in an encoder)
    rope_base: float
    rope_dim: int
    tie_embeddings: bool
    has_qkv_bias: bool
    has_qk_norm: bool
    rope_style: str = "neox"  # "neox" | "norm" (adjacent pairs, Llama)
    has_out_bias: bool = False  # attn_output.bias (Llama's attention_bias)
    has_ffn_bias: bool = False  # ffn_gate / ffn_up / ffn_down biases (Llama's mlp_bias)
    rope_freq_scale: float = 1.0  # linear or YaRN rope scaling: 1 / rope.scaling.factor
    yarn: Yarn | None = None  # YaRN's further parameters (rope.scaling.type = yarn)
    has_rope_freqs: bool = False  # a `rope_freqs.weight` of per-pair factors (Llama 3.1)
    attn_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # attn_logit_softcapping (0: none)
    final_softcap: float = 0.0  # final_logit_softcapping (0: none)
    sliding_window: int = 0  # window of the sliding-window layers (0: none)
    swa_layers: tuple[bool, ...] = ()  # per layer: whether it uses the sliding window
    rope_base_swa: float = DEFAULT_ROPE_BASE  # rope base of the sliding-window layers
    rope_freq_scale_swa: float = 1.0  # their rope scaling (llama.cpp's rope_freq_scale_train_swa)
    attn_sinks: bool = False  # a learned logit per head in each softmax's sum (`attn_sinks`)
    causal: bool = True  # False: an encoder (bidirectional attention within each input)
    pooling: str = "none"  # the file's `pooling_type` (POOLING_TYPES), for embeddings
    n_token_types: int = 0  # rows of an encoder's token-type embedding (0: none)
    n_cls_out: int = 0  # outputs of a classifier head (`cls.output`; rank pooling); 0: none
    has_cls_dense: bool = False  # the head's dense + tanh layer (`cls.weight`) before it
    rank_softmax: bool = False  # the head's outputs softmaxed (llama.cpp: a qwen3 reranker)
    n_expert: int = 0  # experts per MoE block (0: a dense FFN)
    n_expert_used: int = 0  # experts each token is routed to (top-k)
    expert_norm: bool = False  # renormalise the top-k soft-max weights to sum to 1
    n_ff_shexp: int = 0  # width of the shared expert (0: none)
    moe_gating: str = "softmax"  # "softmax": top-k of soft-maxed logits; "softmax_weight":
    # top-k of the logits, soft-maxed among themselves (gpt-oss)
    moe_act: str = "silu"  # the experts' gate: "silu" (SwiGLU) or "swiglu_oai" (gpt-oss)
    moe_bias: bool = False  # router and expert biases (`ffn_gate_inp.bias`, `ffn_*_exps.bias`)
    # (n_ff: in a MoE model, the width of each expert)
    qkv_fused: bool = False  # one `attn_qkv` projection, its output [q | k | v] (Phi-3)
    ffn_up_gate: bool = False  # `ffn_up` holds [gate | up], 2 n_ff wide; no `ffn_gate` (Phi-3)
    no_rope_step: int = 0  # layers il with (il + 1) % step == 0 skip RoPE (SmolLM3: 4); 0: none
    longrope_ctx: int = 0  # LongRoPE's original context: its long factors past it (0: none)
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor outside YaRN: cos, sin times it
    # per layer: recurrent (LFM2's short convolution, no KV cells) rather than attention
    recurrent_layers: tuple[bool, ...] = ()
    shortconv_l_cache: int = 0  # taps of the short convolution (its state: the last taps - 1)
    output_norm_name: str = "output_norm.weight"  # LFM2's is `token_embd_norm.weight`
    # Gemma 4: the sliding-window layers' own head size and rotary dims (0: head_dim, rope_dim)
    head_dim_swa: int = 0
    rope_dim_swa: int = 0
    n_layer_kv: int = 0  # layers with their own KV; the later ones reuse an earlier one's (0: all)
    n_embd_per_layer: int = 0  # width of each layer's per-layer token embedding (0: none)
    v_norm: bool = False  # V rows RMS-normed per head, without a weight (Gemma 4)
    layer_scales: tuple[float, ...] = ()  # per layer: its output times this (Gemma 4)
    layer_kv_heads: tuple[int, ...] = ()  # per layer K/V heads (Gemma 4's array; () n_head_kv)
    v_from_k: tuple[bool, ...] = ()  # per layer: no attn_v, V is K's projection (Gemma 4 31B)
    n_ff_exp: int = 0  # Gemma 4 26B-A4B: its experts' width, beside the dense FFN's n_ff
    layer_ff: tuple[int, ...] = ()  # per layer FFN width (Gemma 4's double-wide MLP); () n_ff
    # the pre-FFN norm's tensor (gpt-oss and Qwen3.5: `post_attention_norm`)
    ffn_norm_name: str = "ffn_norm"
    # Qwen3.5's Gated DeltaNet layers (ssm.*): key heads (group_count), value heads
    # (time_step_rank), each head_dim (state_size) wide; 0: none. Their convolution's taps are
    # `shortconv_l_cache` (ssm.conv_kernel) over q | k | v.
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    attn_gated: bool = False  # q projection doubled per head: query | gate (sigmoid on output)
    n_layer_nextn: int = 0  # MTP (NextN) blocks stored after the n_layer trunk (`mtp_head`)
    # layers below this one are not run: the trunk, in the MTP head's view (`mtp_head`)
    first_layer: int = 0

    def mtp_head(self) -> HParams:
        """The file's first MTP (NextN) block as a model of its own (`models.qwen35`'s
        `build_mtp_head`): that block is layer n_layer of a model whose layers below it (the
        trunk) are not run, hold no KV cells and no state, so an Engine over it keeps the
        block's KV alone. ModelError when the file has no MTP block."""
        if not self.n_layer_nextn:
            raise ModelError(f"this {self.arch} file has no MTP (NextN) layers (converted with "
                             "--no-mtp?)")
        return replace(self, n_layer=self.n_layer + 1, first_layer=self.n_layer,
                       recurrent_layers=())
    rope_sections: tuple[int, ...] = ()  # interleaved M-RoPE's t / h / w / e pairs; (): one pos
    n_deepstack: int = 0  # deepstack blocks after the main n_embd of a given (image) row

    @property
    def reranker(self) -> bool:
        """A model made to score (query, document) pairs: rank pooling and a classifier head
        (a BERT cross-encoder, Qwen3-Reranker); served for reranking, not for generation (a
        converted decoder reranker may keep only its head's rows of the output projection)."""
        return self.pooling == "rank" and self.n_cls_out > 0

    @property
    def n_ctx_max(self) -> int:
        """The longest context minfer gives the model: its trained one, or with YaRN the
        original context stretched by the factor when that is longer (a Qwen2.5 config with
        YaRN keeps `max_position_embeddings` at the original 32768)."""
        if self.yarn is None:
            return self.n_ctx_train
        return max(self.n_ctx_train, int(self.yarn.n_ctx_orig * self.yarn.factor))

    def fit_n_ctx(self, requested: int, what: str = "n_ctx") -> int:
        """The context a run gets for a requested size: the request, or `n_ctx_max` where it
        asks for more, said in a warning (on every surface: the CLI's stderr, the server's
        log); only the surfaces' default (`DEFAULT_N_CTX`, "4096 or the model's") is capped
        without one."""
        if requested <= self.n_ctx_max:
            return requested
        if requested != DEFAULT_N_CTX:
            log.warning("%s = %d exceeds the model's context length (%d); capped to %d",
                        what, requested, self.n_ctx_max, self.n_ctx_max)
        return self.n_ctx_max

    @property
    def kq_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def layer_rope_base(self, layer: int) -> float:
        return self.rope_base_swa if self.is_swa(layer) else self.rope_base

    def layer_rope_freq_scale(self, layer: int) -> float:
        """Rope scaling of the layer: the sliding-window layers' own (llama.cpp keeps Gemma 3's
        at their trained scale, 1; gpt-oss scales them as the global ones)."""
        return self.rope_freq_scale_swa if self.is_swa(layer) else self.rope_freq_scale

    def layer_rope_yarn(self, layer: int) -> YarnRope:
        """The layer's YaRN terms, from its own base and scale; without YaRN only the magnitude
        `rope.scaling.attn_factor` (LongRoPE's), as llama.cpp passes it to every rope."""
        if self.yarn is None:
            return NO_YARN if self.rope_attn_factor == 1.0 else \
                YarnRope(mscale=self.rope_attn_factor)
        return self.yarn.layer(rope_dim=self.rope_dim, base=self.layer_rope_base(layer),
                               freq_scale=self.layer_rope_freq_scale(layer))

    def layer_has_rope(self, layer: int) -> bool:
        """Whether the layer rotates q and k (SmolLM3 leaves every 4th layer without)."""
        return not self.no_rope_step or (layer + 1) % self.no_rope_step != 0

    def rope_factors(self, n_ctx: int) -> str | None:
        """The tensor of per-pair frequency divisors a rope reads in a context of n_ctx cells,
        as llama.cpp's `get_rope_factors` chooses it: Llama 3.1's `rope_freqs`; LongRoPE's
        long factors where the context (padded to 256 cells, as llama.cpp pads n_ctx) is
        longer than the original one, its short ones otherwise; None without factors."""
        if self.has_rope_freqs:
            return "rope_freqs.weight"
        if not self.longrope_ctx:
            return None
        padded = -(-n_ctx // LONGROPE_CTX_PAD) * LONGROPE_CTX_PAD
        return ("rope_factors_long.weight" if padded > self.longrope_ctx
                else "rope_factors_short.weight")

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim_swa if self.head_dim_swa and self.is_swa(layer) else self.head_dim

    def layer_rope_dim(self, layer: int) -> int:
        return self.rope_dim_swa if self.rope_dim_swa and self.is_swa(layer) else self.rope_dim

    def layer_n_head_kv(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.n_head_kv

    def layer_v_from_k(self, layer: int) -> bool:
        return bool(self.v_from_k) and self.v_from_k[layer]

    def layer_kv_embd(self, layer: int) -> int:
        """Width of the layer's K (and V) rows; 0 where it reuses an earlier layer's KV, or
        is not run (below `first_layer`)."""
        if layer < self.first_layer:
            return 0
        return self.layer_n_head_kv(layer) * self.layer_head_dim(layer) \
            if self.kv_layer(layer) == layer else 0

    def kv_layer(self, layer: int) -> int:
        """The layer whose KV cells this one attends over: itself, or past `n_layer_kv` (Gemma
        4's shared-KV layers) the last layer of the same kind (sliding or global) with its own
        KV, as transformers picks it (llama.cpp's n_layer_kv - 2 / - 1 is the same layer in
        every released file)."""
        if not self.n_layer_kv or layer < self.n_layer_kv:
            return layer
        return max(il for il in range(self.n_layer_kv) if self.is_swa(il) == self.is_swa(layer))

    def layer_window(self, layer: int) -> int:
        return self.sliding_window if self.is_swa(layer) else 0

    def is_recurrent(self, layer: int) -> bool:
        """Whether the layer carries a recurrent state instead of KV cells."""
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def recurrent(self) -> bool:
        """Whether any layer carries a recurrent state (which cannot be rewound by truncation,
        unlike KV cells)."""
        return any(self.recurrent_layers)

    @property
    def conv_channels(self) -> int:
        """Channels of a recurrent layer's convolution: LFM2's n_embd, Qwen3.5's q | k | v."""
        if self.ssm_head_dim:
            return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim
        return self.n_embd

    @property
    def state_width(self) -> int:
        """Floats one sequence's state takes in one recurrent layer: the convolution's last
        `l_cache - 1` inputs of every channel, and a Gated DeltaNet's state matrix per value
        head."""
        if not self.recurrent:
            return 0
        return (self.shortconv_l_cache - 1) * self.conv_channels + \
            self.ssm_v_heads * self.ssm_head_dim ** 2

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> HParams:
        arch = f.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f.path, "missing metadata key 'general.architecture'")
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(f"{f.path}: architecture {arch!r} is not supported "
                             f"(minfer runs {', '.join(SUPPORTED_ARCHS)})")
        keys = _Keys(f, arch)
        if arch in ENCODER_ARCHS:
            hp = _encoder(f, keys)
            hp.check_tensors(f)
            return hp
        n_embd = keys.get_int("embedding_length")
        n_head = keys.get_int("attention.head_count")
        recurrent: tuple[bool, ...] = ()
        kv_heads: tuple[int, ...] = ()
        layer_ff: tuple[int, ...] = ()
        if arch == "gemma4" and not isinstance(
                ff := f.metadata.get(f"{arch}.feed_forward_length"), int | None):
            layer_ff = tuple(int(x) for x in ff)  # use_double_wide_mlp: the shared layers 2x
        if arch in RECURRENT_ARCHS:
            n_head_kv, recurrent = _layer_kv_heads(keys)
        elif arch == "gemma4" and not isinstance(
                heads := f.metadata.get(f"{arch}.attention.head_count_kv"), int | None):
            kv_heads = tuple(int(h) for h in heads)  # Gemma 4 26B / 31B: fewer in global layers
            n_head_kv = max(kv_heads, default=0)
            if len(kv_heads) != keys.get_int("block_count") or any(
                    h < 1 or n_head % h for h in kv_heads):
                raise GGUFError(f.path, f"head_count_kv={list(kv_heads)} does not give each "
                                        f"layer a divisor of head_count={n_head}")
        else:
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
            n_ff=layer_ff[0] if layer_ff else keys.get_int(
                "feed_forward_length", 0 if arch in MOE_ARCHS else None,
                allow_zero=arch in MOE_ARCHS),
            n_vocab=embd.shape[1],
            n_ctx_train=keys.get_int("context_length"),
            rms_eps=keys.get_float("attention.layer_norm_rms_epsilon"),
            rope_base=keys.get_float("rope.freq_base", DEFAULT_ROPE_BASE),
            rope_dim=rope_dim,
            tie_embeddings="output.weight" not in f.tensors,
            has_qkv_bias=any(f"blk.0.attn_{w}.bias" in f.tensors for w in ("q", "qkv")),
            has_out_bias="blk.0.attn_output.bias" in f.tensors,
            has_ffn_bias="blk.0.ffn_down.bias" in f.tensors,
            has_qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
            rope_style="norm" if arch in NORM_ROPE_ARCHS else "neox",
            rope_freq_scale=_rope_freq_scale(keys),
            yarn=_yarn(keys),
            rope_attn_factor=_rope_attn_factor(keys),
            has_rope_freqs="rope_freqs.weight" in f.tensors,
            attn_softcap=keys.get_float("attn_logit_softcapping", 0.0, allow_zero=True),
            final_softcap=keys.get_float("final_logit_softcapping", 0.0, allow_zero=True),
            pooling=_pooling(keys),
            n_cls_out=_cls_out(f),
            rank_softmax=arch == "qwen3",  # llama.cpp's build_pooling: only for qwen3
            qkv_fused=_qkv_fused(f),
            ffn_up_gate=arch in GATE_UP_ARCHS,
            no_rope_step=NO_ROPE_STEP.get(arch, 0),
            longrope_ctx=_longrope_ctx(keys),
        )
        if arch == "gemma3":
            hp = _gemma3(hp, keys)
        if arch == "gemma4":
            hp = _gemma4(replace(_gemma3(hp, keys), layer_kv_heads=kv_heads, layer_ff=layer_ff),
                         keys)
        if recurrent:
            hp = _lfm2(hp, keys, recurrent)
        if arch == "gpt-oss":
            hp = _gptoss(hp, keys)
        if arch in QWEN35_ARCHS:
            hp = _qwen35(hp, keys)
        if arch in MROPE_ARCHS:
            hp = _mrope(hp, keys)
        if arch in MOE_ARCHS or (arch == "llama" and keys.get_int("expert_count", 0,
                                                                  allow_zero=True)):
            hp = _moe(hp, keys)
        hp.check_tensors(f)
        return hp

    def expected_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, GGUF ne shape) of every tensor the forward pass reads."""
        q_dim = self.n_head * self.head_dim
        kv_dim = self.n_head_kv * self.head_dim
        if not self.causal:
            yield from self._encoder_shapes(q_dim, kv_dim)
            return
        yield "token_embd.weight", (self.n_embd, self.n_vocab)
        yield self.output_norm_name, (self.n_embd,)
        if self.n_cls_out:  # a decoder reranker's head (Qwen3-Reranker: yes / no)
            yield "cls.output.weight", (self.n_embd, self.n_cls_out)
        if self.has_rope_freqs:
            yield "rope_freqs.weight", (self.rope_dim // 2,)
        if self.longrope_ctx:
            yield "rope_factors_long.weight", (self.rope_dim // 2,)
            yield "rope_factors_short.weight", (self.rope_dim // 2,)
        if not self.tie_embeddings:
            yield "output.weight", (self.n_embd, self.n_vocab)
        yield from self._per_layer_embd_shapes()
        if self.first_layer:  # an MTP head: the NextN block's own tensors besides its layer
            blk = f"blk.{self.first_layer}.nextn"
            yield f"{blk}.eh_proj.weight", (2 * self.n_embd, self.n_embd)
            yield f"{blk}.enorm.weight", (self.n_embd,)
            yield f"{blk}.hnorm.weight", (self.n_embd,)
        for i in range(self.first_layer, self.n_layer):
            blk = f"blk.{i}"
            yield f"{blk}.attn_norm.weight", (self.n_embd,)
            if not self.is_recurrent(i):
                yield from self._attention_shapes(blk, i)
            elif self.ssm_head_dim:
                yield from self._delta_net_shapes(blk)
            else:
                yield from self._shortconv_shapes(blk)
            if self.arch in SANDWICH_ARCHS:
                yield f"{blk}.post_attention_norm.weight", (self.n_embd,)
                yield f"{blk}.post_ffw_norm.weight", (self.n_embd,)
            if self.n_embd_per_layer:
                yield f"{blk}.inp_gate.weight", (self.n_embd, self.n_embd_per_layer)
                yield f"{blk}.proj.weight", (self.n_embd_per_layer, self.n_embd)
                yield f"{blk}.post_norm.weight", (self.n_embd,)
            if self.layer_scales:
                yield f"{blk}.layer_output_scale.weight", (1,)
            yield f"{blk}.{self.ffn_norm_name}.weight", (self.n_embd,)
            if self.n_ff_exp:  # Gemma 4's experts beside its dense FFN
                yield from self._gemma4_expert_shapes(blk)
            elif self.n_expert:
                yield from self._expert_shapes(blk)
                continue
            if self.ffn_up_gate:
                yield f"{blk}.ffn_up.weight", (self.n_embd, 2 * self.n_ff)
                yield f"{blk}.ffn_down.weight", (self.n_ff, self.n_embd)
                continue
            n_ff = self.layer_ff[i] if self.layer_ff else self.n_ff
            yield f"{blk}.ffn_gate.weight", (self.n_embd, n_ff)
            yield f"{blk}.ffn_up.weight", (self.n_embd, n_ff)
            yield f"{blk}.ffn_down.weight", (n_ff, self.n_embd)
            if self.has_ffn_bias:
                yield f"{blk}.ffn_gate.bias", (self.n_ff,)
                yield f"{blk}.ffn_up.bias", (self.n_ff,)
                yield f"{blk}.ffn_down.bias", (self.n_embd,)

    def _per_layer_embd_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Gemma 4's per-layer token embeddings: n_embd_per_layer for every layer from each
        token, and from the scaled token embedding through a projection and a norm."""
        if not self.n_embd_per_layer:
            return
        width = self.n_embd_per_layer * self.n_layer
        yield "per_layer_token_embd.weight", (width, self.n_vocab)
        yield "per_layer_model_proj.weight", (self.n_embd, width)
        yield "per_layer_proj_norm.weight", (self.n_embd_per_layer,)

    def _attention_shapes(self, blk: str, il: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        """An attention layer's projections (fused or not, optionally biased) and q/k norms
        (only q's where the layer reuses an earlier layer's KV)."""
        head_dim = self.layer_head_dim(il)
        q_dim, kv_dim = self.n_head * head_dim, self.layer_n_head_kv(il) * head_dim
        if self.kv_layer(il) != il:
            yield f"{blk}.attn_q.weight", (self.n_embd, q_dim)
            yield f"{blk}.attn_q_norm.weight", (head_dim,)
            yield f"{blk}.attn_output.weight", (q_dim, self.n_embd)
            return
        if self.qkv_fused:
            yield f"{blk}.attn_qkv.weight", (self.n_embd, q_dim + 2 * kv_dim)
            if self.has_qkv_bias:
                yield f"{blk}.attn_qkv.bias", (q_dim + 2 * kv_dim,)
        else:
            yield f"{blk}.attn_q.weight", (self.n_embd, 2 * q_dim if self.attn_gated else q_dim)
            yield f"{blk}.attn_k.weight", (self.n_embd, kv_dim)
            if not self.layer_v_from_k(il):
                yield f"{blk}.attn_v.weight", (self.n_embd, kv_dim)
        if self.has_qkv_bias and not self.qkv_fused:
            yield f"{blk}.attn_q.bias", (q_dim,)
            yield f"{blk}.attn_k.bias", (kv_dim,)
            yield f"{blk}.attn_v.bias", (kv_dim,)
        if self.has_qk_norm:
            yield f"{blk}.attn_q_norm.weight", (head_dim,)
            yield f"{blk}.attn_k_norm.weight", (head_dim,)
        yield f"{blk}.attn_output.weight", (q_dim, self.n_embd)
        if self.has_out_bias:
            yield f"{blk}.attn_output.bias", (self.n_embd,)
        if self.attn_sinks:
            yield f"{blk}.attn_sinks.weight", (self.n_head,)

    def _shortconv_shapes(self, blk: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        """LFM2's short-convolution block: B | C | x projected at once, the depthwise taps
        (`[l_cache, n_embd]`), the output projection."""
        yield f"{blk}.shortconv.in_proj.weight", (self.n_embd, 3 * self.n_embd)
        yield f"{blk}.shortconv.conv.weight", (self.shortconv_l_cache, self.n_embd)
        yield f"{blk}.shortconv.out_proj.weight", (self.n_embd, self.n_embd)

    def _delta_net_shapes(self, blk: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Qwen3.5's Gated DeltaNet block: q | k | v and the z gate projected, the convolution's
        taps, the step bias and decay per value head, their alpha / beta projections, the
        gated norm (one head wide), the output projection."""
        n_v, value_dim = self.ssm_v_heads, self.ssm_v_heads * self.ssm_head_dim
        yield f"{blk}.attn_qkv.weight", (self.n_embd, self.conv_channels)
        yield f"{blk}.attn_gate.weight", (self.n_embd, value_dim)
        yield f"{blk}.ssm_conv1d.weight", (self.shortconv_l_cache, self.conv_channels)
        yield f"{blk}.ssm_dt.bias", (n_v,)
        yield f"{blk}.ssm_a", (n_v,)
        yield f"{blk}.ssm_alpha.weight", (self.n_embd, n_v)
        yield f"{blk}.ssm_beta.weight", (self.n_embd, n_v)
        yield f"{blk}.ssm_norm.weight", (self.ssm_head_dim,)
        yield f"{blk}.ssm_out.weight", (value_dim, self.n_embd)

    def _expert_shapes(self, blk: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        """A MoE block's FFN tensors as llama.cpp names them: the router, the experts' gate /
        up / down stacked in 3-D tensors, and the shared expert with its gate."""
        n_embd, n_ff, n_exp = self.n_embd, self.n_ff, self.n_expert
        yield f"{blk}.ffn_gate_inp.weight", (n_embd, n_exp)
        yield f"{blk}.ffn_gate_exps.weight", (n_embd, n_ff, n_exp)
        yield f"{blk}.ffn_up_exps.weight", (n_embd, n_ff, n_exp)
        yield f"{blk}.ffn_down_exps.weight", (n_ff, n_embd, n_exp)
        if self.moe_bias:
            yield f"{blk}.ffn_gate_inp.bias", (n_exp,)
            yield f"{blk}.ffn_gate_exps.bias", (n_ff, n_exp)
            yield f"{blk}.ffn_up_exps.bias", (n_ff, n_exp)
            yield f"{blk}.ffn_down_exps.bias", (n_embd, n_exp)
        if self.n_ff_shexp:
            yield f"{blk}.ffn_gate_inp_shexp.weight", (n_embd,)
            yield f"{blk}.ffn_gate_shexp.weight", (n_embd, self.n_ff_shexp)
            yield f"{blk}.ffn_up_shexp.weight", (n_embd, self.n_ff_shexp)
            yield f"{blk}.ffn_down_shexp.weight", (self.n_ff_shexp, n_embd)

    def _gemma4_expert_shapes(self, blk: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Gemma 4 26B-A4B's experts: a router over the RMS-normed input scaled per channel,
        their own pre / post norms, [gate | up] stacked in one tensor, a scale per expert."""
        n_embd, n_ff, n_exp = self.n_embd, self.n_ff_exp, self.n_expert
        yield f"{blk}.ffn_gate_inp.weight", (n_embd, n_exp)
        yield f"{blk}.ffn_gate_inp.scale", (n_embd,)
        for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
            yield f"{blk}.{norm}.weight", (n_embd,)
        yield f"{blk}.ffn_gate_up_exps.weight", (n_embd, 2 * n_ff, n_exp)
        yield f"{blk}.ffn_down_exps.weight", (n_ff, n_embd, n_exp)
        yield f"{blk}.ffn_down_exps.scale", (n_exp,)

    def active_share(self, name: str, n: int) -> int:
        """Of the n parameters (or bytes) of tensor `name`, those one token reads: a stacked
        expert tensor's `n_expert_used` experts, every other tensor whole."""
        return n * self.n_expert_used // self.n_expert if "_exps." in name else n

    def n_params(self) -> tuple[int, int]:
        """(total, active per token) parameter counts of the tensors the forward pass reads.
        A token reads one row of an untied embedding table (OpenAI's count: gpt-oss-20b's
        20.9 B total, 3.6 B active); a tied one is read whole as the output projection."""
        sizes = [(name, math.prod(shape)) for name, shape in self.expected_shapes()]
        active = sum(self.active_share(name, n) for name, n in sizes)
        if not self.tie_embeddings and self.causal:
            active -= self.n_embd * (self.n_vocab - 1)
        return sum(n for _, n in sizes), active

    def _encoder_shapes(self, q_dim: int, kv_dim: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        """BERT's tensors as llama.cpp names them (every projection with its bias, post-norm
        LayerNorms with theirs)."""
        n_embd = self.n_embd
        yield "token_embd.weight", (n_embd, self.n_vocab)
        yield "position_embd.weight", (n_embd, self.n_ctx_train)
        if self.n_token_types:
            yield "token_types.weight", (n_embd, self.n_token_types)
        yield "token_embd_norm.weight", (n_embd,)
        yield "token_embd_norm.bias", (n_embd,)
        for i in range(self.n_layer):
            blk = f"blk.{i}"
            for name, n_out in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                yield f"{blk}.{name}.weight", (n_embd, n_out)
                yield f"{blk}.{name}.bias", (n_out,)
            yield f"{blk}.attn_output.weight", (q_dim, n_embd)
            yield f"{blk}.attn_output.bias", (n_embd,)
            yield f"{blk}.attn_output_norm.weight", (n_embd,)
            yield f"{blk}.attn_output_norm.bias", (n_embd,)
            yield f"{blk}.ffn_up.weight", (n_embd, self.n_ff)
            yield f"{blk}.ffn_up.bias", (self.n_ff,)
            yield f"{blk}.ffn_down.weight", (self.n_ff, n_embd)
            yield f"{blk}.ffn_down.bias", (n_embd,)
            yield f"{blk}.layer_output_norm.weight", (n_embd,)
            yield f"{blk}.layer_output_norm.bias", (n_embd,)
        if self.has_cls_dense:
            yield "cls.weight", (n_embd, n_embd)
            yield "cls.bias", (n_embd,)
        if self.n_cls_out:
            yield "cls.output.weight", (n_embd, self.n_cls_out)

    def check_tensors(self, f: GGUFFile) -> None:
        """Raise GGUFError naming the first required tensor that is missing or misshapen."""
        for name, shape in self.expected_shapes():
            t = f.tensors.get(name)
            if t is None:
                raise GGUFError(f.path, f"missing tensor {name!r}")
            if _squeezed(t.shape) != _squeezed(shape):  # ggml pads ne with ones: [n, 1] is [n]
                raise GGUFError(f.path, f"tensor {name!r} has shape {list(t.shape)}, "
                                        f"expected {list(shape)}")


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GGUF ne shape without its trailing ones."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return shape[:n]


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

    def get_int(self, key: str, default: int | None = None, *, allow_zero: bool = False) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero
                                                                             else 1):
            raise GGUFError(self.f.path, f"{self.arch}.{key}={value!r} is not a positive integer")
        return value

    def get_float(self, key: str, default: float | None = None, *,
                  allow_zero: bool = False) -> float:
        value = self._get(key, default)
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        low_ok = numeric and (value >= 0 if allow_zero else value > 0)
        if not low_ok or not value < math.inf:
            raise GGUFError(self.f.path, f"{self.arch}.{key}={value!r} is not a positive number")
        return float(value)

    def get_str(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise GGUFError(self.f.path, f"{self.arch}.{key}={value!r} is not a string")
        return value


def _pooling(keys: _Keys) -> str:
    """The file's `pooling_type` by name (none when absent, as llama.cpp)."""
    value = keys.get_int("pooling_type", 0, allow_zero=True)
    if value >= len(POOLING_TYPES):
        raise GGUFError(keys.f.path, f"{keys.arch}.pooling_type={value} is not one of "
                                     f"0..{len(POOLING_TYPES) - 1} ({', '.join(POOLING_TYPES)})")
    return POOLING_TYPES[value]


def _encoder(f: GGUFFile, keys: _Keys) -> HParams:
    """A BERT encoder's hyper-parameters, as llama.cpp's `llama_model_bert` reads them: sizes,
    the LayerNorm epsilon, learned positions (`position_embd` has context_length rows),
    optional token-type embeddings and classifier head (rank pooling)."""
    n_embd = keys.get_int("embedding_length")
    n_head = keys.get_int("attention.head_count")
    n_head_kv = keys.get_int("attention.head_count_kv", n_head)
    if n_embd % n_head or n_head % n_head_kv:
        raise GGUFError(f.path, f"embedding_length={n_embd} does not split into {n_head} heads "
                                f"over {n_head_kv} K/V heads")
    if f.metadata.get(f"{keys.arch}.attention.causal", False) is True:
        raise ModelError(f"{f.path}: a causal {keys.arch} is not supported (minfer runs "
                         f"{keys.arch} as a bidirectional encoder)")
    embd = f.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise GGUFError(f.path, "missing 2-D tensor 'token_embd.weight'")
    pos = f.tensors.get("position_embd.weight")
    if pos is None:
        raise GGUFError(f.path, "missing tensor 'position_embd.weight' (BERT's learned "
                                "positions)")
    types = f.tensors.get("token_types.weight")
    return HParams(
        arch=keys.arch,
        n_layer=keys.get_int("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=n_embd // n_head,
        n_ff=keys.get_int("feed_forward_length"),
        n_vocab=embd.shape[1],
        n_ctx_train=keys.get_int("context_length"),
        rms_eps=keys.get_float("attention.layer_norm_epsilon"),
        rope_base=DEFAULT_ROPE_BASE,
        rope_dim=n_embd // n_head,
        tie_embeddings=True,
        has_qkv_bias=True,
        has_qk_norm=False,
        causal=False,
        pooling=_pooling(keys),
        n_token_types=types.shape[1] if types is not None and len(types.shape) == 2 else 0,
        n_cls_out=_cls_out(f),
        has_cls_dense="cls.weight" in f.tensors,
    )


def _cls_out(f: GGUFFile) -> int:
    """Outputs of the classifier head `cls.output` (a reranker's), 0 without one."""
    cls_out = f.tensors.get("cls.output.weight")
    if cls_out is None:
        return 0
    if len(cls_out.shape) != 2:
        raise GGUFError(f.path, "tensor 'cls.output.weight' is not 2-D")
    return cls_out.shape[1]


def _moe(hp: HParams, keys: _Keys) -> HParams:
    """A mixture of experts' counts, as llama.cpp reads them; the expert tensors' shapes are
    checked against them with the rest (`check_tensors`)."""
    n_expert = keys.get_int("expert_count")
    n_used = keys.get_int("expert_used_count")
    if n_used > n_expert:
        raise GGUFError(keys.f.path, f"{keys.arch}.expert_used_count={n_used} exceeds "
                                     f"expert_count={n_expert}")
    norm = keys.f.metadata.get(f"{keys.arch}.expert_weights_norm",
                               _MOE_NORM_DEFAULT[keys.arch])
    if not isinstance(norm, bool):
        raise GGUFError(keys.f.path, f"{keys.arch}.expert_weights_norm={norm!r} is not a bool")
    # llama.cpp's fallbacks: an expert n_ff / n_used wide (llama: n_ff), a shared expert n_ff
    n_ff_exp = keys.get_int("expert_feed_forward_length",
                            hp.n_ff if keys.arch == "llama" else hp.n_ff // n_used or None)
    shexp = 0
    if keys.arch in _SHEXP_ARCHS and "blk.0.ffn_gate_inp_shexp.weight" in keys.f.tensors:
        shexp = keys.get_int("expert_shared_feed_forward_length", hp.n_ff or None)
    return replace(hp, n_ff=n_ff_exp, n_expert=n_expert, n_expert_used=n_used,
                   expert_norm=norm, n_ff_shexp=shexp)


def _rope_freq_scale(keys: _Keys) -> float:
    """1 / rope.scaling.factor for linear and YaRN scaling (and a Phi-3 file's `longrope`,
    whose factors are tensors: `_longrope_ctx`); other scaling types are refused by name."""
    kind = keys.get_str("rope.scaling.type", "none")
    if kind == "none":
        return 1.0
    if kind not in ("linear", "yarn") and not (kind == "longrope"
                                               and keys.arch in LONGROPE_ARCHS):
        raise ModelError(f"{keys.f.path}: rope scaling {kind!r} is not supported for "
                         f"{keys.arch} (minfer runs none, linear and yarn; longrope for "
                         f"{', '.join(LONGROPE_ARCHS)})")
    return 1.0 / keys.get_float("rope.scaling.factor", 1.0)


def _rope_attn_factor(keys: _Keys) -> float:
    """`rope.scaling.attn_factor` outside YaRN (which folds it into its own magnitude): the
    factor llama.cpp multiplies cos and sin by (LongRoPE's sqrt(1 + ln s / ln n_orig), which
    the converter writes for Phi-3)."""
    if keys.get_str("rope.scaling.type", "none") == "yarn":
        return 1.0
    return keys.get_float("rope.scaling.attn_factor", 1.0)


def _longrope_ctx(keys: _Keys) -> int:
    """LongRoPE's original context where the file has its factor tensors (Phi-3), else 0:
    `rope.scaling.original_context_length`, the trained context when absent (llama.cpp's
    n_ctx_orig_yarn)."""
    if keys.arch not in LONGROPE_ARCHS or not {"rope_factors_long.weight",
                                               "rope_factors_short.weight"} & set(keys.f.tensors):
        return 0
    return keys.get_int("rope.scaling.original_context_length", keys.get_int("context_length"))


def _qkv_fused(f: GGUFFile) -> bool:
    """Whether the attention projects q, k and v with one `attn_qkv` matrix (llama.cpp takes it
    over separate ones). Its bias is `attn_qkv.bias`; separate q/k/v biases beside a fused
    matrix (which llama.cpp concatenates) are refused by name."""
    if "blk.0.attn_qkv.weight" not in f.tensors:
        return False
    if "blk.0.attn_q.bias" in f.tensors and "blk.0.attn_qkv.bias" not in f.tensors:
        raise ModelError(f"{f.path}: a fused attn_qkv with separate q/k/v biases is not "
                         "supported (minfer reads attn_qkv.bias)")
    return True


def _yarn(keys: _Keys) -> Yarn | None:
    """YaRN's parameters as llama.cpp reads them for the architectures minfer runs: the factor,
    the original context (the trained one when absent) and `rope.scaling.attn_factor`.
    llama.cpp reads `rope.scaling.yarn_{ext_factor,attn_factor,beta_fast,beta_slow}` and
    `yarn_log_multiplier` only for other architectures (Grok, DeepSeek, ...), so a file's betas
    (which its converter writes from a config that gives them) are left at 32 / 1 here too,
    where transformers would use them."""
    if keys.get_str("rope.scaling.type", "none") != "yarn":
        return None
    return Yarn(
        factor=keys.get_float("rope.scaling.factor", 1.0),
        n_ctx_orig=keys.get_int("rope.scaling.original_context_length",
                                keys.get_int("context_length")),
        attn_factor=keys.get_float("rope.scaling.attn_factor", 1.0),
    )


def _gemma3(hp: HParams, keys: _Keys) -> HParams:
    """Gemma 3's extras, read as llama.cpp's `llama_model_gemma3::load_arch_hparams` does:
    sliding window and its layer pattern (every Nth layer global, N = 6 by default, or an
    explicit per-layer array), the local rope base, and the attention scale (the 27B model,
    62 layers, scales by n_embd / n_head instead of head_dim; `attention.scale` wins if set)."""
    window, swa = _swa(hp, keys, GEMMA3_SWA_PATTERN)
    if "attention.scale" in keys:
        scale = keys.get_float("attention.scale")
    elif hp.n_layer == 62:
        scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head)
    else:
        scale = 1.0 / math.sqrt(hp.head_dim)
    return replace(hp, sliding_window=window, swa_layers=swa, attn_scale=scale,
                   rope_base_swa=keys.get_float("rope.freq_base_swa", DEFAULT_ROPE_BASE_SWA))


def _gemma4(hp: HParams, keys: _Keys) -> HParams:
    """Gemma 4's extras over Gemma 3's, as llama.cpp's `llama_model_gemma4::load_arch_hparams`
    reads them: attention scale 1 (q and k are normed), the sliding layers' own head size and
    rotary dims, the shared-KV tail (`attention.shared_kv_layers`), the per-layer token
    embeddings' width, V normed per head, and each layer's output scale (a one-element tensor,
    read here as a number); the 26B / 31B's global layers with fewer K/V heads
    (`head_count_kv` an array) and without `attn_v` (V is K's projection, before K's norm)."""
    if hp.layer_ff and len(hp.layer_ff) != hp.n_layer:
        raise GGUFError(keys.f.path, f"feed_forward_length has {len(hp.layer_ff)} entries for "
                                     f"{hp.n_layer} layers")
    n_shared = keys.get_int("attention.shared_kv_layers", 0, allow_zero=True)
    if not 0 <= n_shared < hp.n_layer:
        raise GGUFError(keys.f.path, f"shared_kv_layers={n_shared} leaves no layer its own KV")
    hp = replace(hp, attn_scale=1.0, v_norm=True,
                 head_dim_swa=keys.get_int("attention.key_length_swa", hp.head_dim),
                 rope_dim_swa=keys.get_int("rope.dimension_count_swa", hp.rope_dim),
                 n_layer_kv=hp.n_layer - n_shared if n_shared else 0,
                 n_embd_per_layer=keys.get_int("embedding_length_per_layer_input", 0,
                                               allow_zero=True))
    if keys.get_int("attention.value_length_swa", hp.head_dim_swa) != hp.head_dim_swa:
        raise GGUFError(keys.f.path, "attention.value_length_swa differs from key_length_swa")
    if hp.rope_dim_swa > hp.head_dim_swa or hp.rope_dim_swa % 2:
        raise GGUFError(keys.f.path, f"rope.dimension_count_swa={hp.rope_dim_swa} does not fit "
                                     f"head_dim_swa={hp.head_dim_swa}")
    if n_shared and any(not any(hp.is_swa(j) == hp.is_swa(il) for j in range(hp.n_layer_kv))
                        for il in range(hp.n_layer_kv, hp.n_layer)):
        raise GGUFError(keys.f.path, "a shared-KV layer has no earlier layer of its kind")
    if n_expert := keys.get_int("expert_count", 0, allow_zero=True):  # 26B-A4B
        n_used = keys.get_int("expert_used_count")
        if not 0 < n_used <= n_expert:
            raise GGUFError(keys.f.path, f"expert_used_count={n_used} of {n_expert} experts")
        hp = replace(hp, n_expert=n_expert, n_expert_used=n_used, expert_norm=True,
                     n_ff_exp=keys.get_int("expert_feed_forward_length"))
    v_from_k = tuple(hp.kv_layer(il) == il and f"blk.{il}.attn_v.weight" not in keys.f.tensors
                     for il in range(hp.n_layer))
    hp = replace(hp, v_from_k=v_from_k if any(v_from_k) else ())
    names = [f"blk.{il}.layer_output_scale.weight" for il in range(hp.n_layer)]
    if all(n in keys.f.tensors for n in names):
        scales = tuple(float(keys.f.array(n).reshape(-1)[0]) for n in names)
        hp = replace(hp, layer_scales=scales)
    return hp


def _layer_kv_heads(keys: _Keys) -> tuple[int, tuple[bool, ...]]:
    """A hybrid's `attention.head_count_kv` array: the K/V heads of its attention layers (one
    count for all), and per layer whether it is recurrent (0 heads)."""
    n_layer = keys.get_int("block_count")
    value = keys.f.metadata.get(f"{keys.arch}.attention.head_count_kv")
    heads: list[int] = []
    if isinstance(value, int) and not isinstance(value, bool):
        heads = [value] * n_layer
    elif value is not None and not isinstance(value, str | bool):
        heads = [int(h) for h in value]
    if len(heads) != n_layer:
        raise GGUFError(keys.f.path, f"{keys.arch}.attention.head_count_kv must give each of "
                                     f"the {n_layer} layers its K/V heads (0: recurrent)")
    counts = {h for h in heads if h > 0}
    if len(counts) != 1:
        raise ModelError(f"{keys.f.path}: {keys.arch} attention layers with K/V heads "
                         f"{sorted(counts) or 'none'} are not supported (minfer runs one "
                         "count for every attention layer)")
    return counts.pop(), tuple(h == 0 for h in heads)


def _lfm2(hp: HParams, keys: _Keys, recurrent: tuple[bool, ...]) -> HParams:
    """LFM2's extras, as llama.cpp's `llama_model_lfm2` reads them: the short convolution's
    taps, per-head q / k norms in every attention layer, the final norm stored as
    `token_embd_norm`, and an optional sliding window over the attention layers (rope base
    unchanged). A bidirectional LFM2 (an embedding model) is refused by name."""
    if keys.f.metadata.get(f"{keys.arch}.attention.causal", True) is not True:
        raise ModelError(f"{keys.f.path}: a bidirectional {keys.arch} is not supported (minfer "
                         f"runs {keys.arch} as a causal decoder)")
    l_cache = keys.get_int("shortconv.l_cache")
    if l_cache < 2:
        raise GGUFError(keys.f.path, f"{keys.arch}.shortconv.l_cache={l_cache} leaves no state")
    window = keys.get_int("attention.sliding_window", 0, allow_zero=True)
    return replace(hp, recurrent_layers=recurrent, shortconv_l_cache=l_cache, has_qk_norm=True,
                   output_norm_name="token_embd_norm.weight", sliding_window=window,
                   swa_layers=tuple(not r for r in recurrent) if window else (),
                   rope_base_swa=hp.rope_base)


def _swa(hp: HParams, keys: _Keys, default_pattern: int) -> tuple[int, tuple[bool, ...]]:
    """The sliding window and which layers use it, as llama.cpp's `load_swa_pattern` reads
    them: an explicit per-layer `sliding_window_pattern` array, or a period n (the file's, else
    the architecture's default) where every layer but the last of each n slides (0: all)."""
    window = keys.get_int("attention.sliding_window", 0, allow_zero=True)
    if window == 0:
        return 0, ()
    pattern = keys.f.metadata.get(f"{keys.arch}.attention.sliding_window_pattern",
                                  default_pattern)
    if isinstance(pattern, list | tuple) or getattr(pattern, "ndim", 0) == 1:
        if len(pattern) != hp.n_layer:
            raise GGUFError(keys.f.path, f"sliding_window_pattern has {len(pattern)} entries "
                                         f"for {hp.n_layer} layers")
        return window, tuple(bool(x) for x in pattern)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        return window, tuple(pattern == 0 or il % pattern < pattern - 1
                             for il in range(hp.n_layer))
    raise GGUFError(keys.f.path, f"sliding_window_pattern={pattern!r} is not valid")


def _gptoss(hp: HParams, keys: _Keys) -> HParams:
    """gpt-oss's extras, as llama.cpp's `llama_model_openai_moe` reads and builds them: the
    sliding window on every other layer (pattern 2: the even layers) with the global layers'
    rope base (unless `rope.freq_base_swa`) and scaling, attention sinks, the router's and
    experts' biases, top-k routing soft-maxed over the chosen logits, the clamped SwiGLU, and
    the pre-FFN norm named `post_attention_norm`."""
    window, swa = _swa(hp, keys, GPTOSS_SWA_PATTERN)
    return replace(hp, sliding_window=window, swa_layers=swa, attn_sinks=True,
                   rope_base_swa=keys.get_float("rope.freq_base_swa", hp.rope_base),
                   rope_freq_scale_swa=hp.rope_freq_scale, moe_gating="softmax_weight",
                   moe_act="swiglu_oai", moe_bias=True, ffn_norm_name="post_attention_norm")


def _qwen35(hp: HParams, keys: _Keys) -> HParams:
    """Qwen3.5's extras (dense or MoE: the FFNs are read by `_moe`), as llama.cpp's
    `llama_model_qwen35` / `llama_model_qwen35moe` read them: the trunk is
    block_count - nextn_predict_layers layers (the MTP blocks after it: `HParams.mtp_head`); its
    recurrent layers from `attention.recurrent_layers` or else every layer but each
    `full_attention_interval`-th; the Gated DeltaNet sizes (ssm.*); the gated attention's
    doubled q projection with q / k norms; interleaved MRoPE, which on text positions is NEOX
    RoPE over the rotated dims where its sections cover them; the FFN's pre-norm stored as
    `post_attention_norm`."""
    path = keys.f.path
    n_nextn = keys.get_int("nextn_predict_layers", 0, allow_zero=True)
    n_all = keys.get_int("block_count")
    n_layer = n_all - n_nextn
    if n_layer < 1:
        raise GGUFError(path, f"{n_nextn} MTP layers leave no trunk of the {n_all} blocks")
    flags = keys.f.metadata.get(f"{keys.arch}.attention.recurrent_layers")
    if flags is not None:
        recurrent = tuple(bool(r) for r in flags)[:n_layer]
    else:
        interval = keys.get_int("full_attention_interval", 4)
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    if len(recurrent) != n_layer:
        raise GGUFError(path, f"{keys.arch}.attention.recurrent_layers does not give each of "
                              f"the {n_layer} layers a flag")
    head = keys.get_int("ssm.state_size")
    k_heads, v_heads = keys.get_int("ssm.group_count"), keys.get_int("ssm.time_step_rank")
    if v_heads % k_heads or keys.get_int("ssm.inner_size") != v_heads * head:
        raise ModelError(f"{path}: {keys.arch} with {k_heads} key heads, {v_heads} value heads "
                         f"of {head} and inner size {keys.get_int('ssm.inner_size')} is not "
                         "supported (value heads grouped over key heads, key and value heads "
                         "equally wide)")
    d_conv = keys.get_int("ssm.conv_kernel")
    if d_conv < 2:
        raise GGUFError(path, f"{keys.arch}.ssm.conv_kernel={d_conv} leaves no state")
    sections = keys.f.metadata.get(f"{keys.arch}.rope.dimension_sections")
    if sections is None or 2 * sum(int(s) for s in list(sections)[:3]) < hp.rope_dim:
        raise ModelError(f"{path}: {keys.arch}'s MRoPE sections {sections} do not cover the "
                         f"{hp.rope_dim} rotated dims (minfer runs text positions only)")
    return replace(hp, n_layer=n_layer, n_layer_nextn=n_nextn, recurrent_layers=recurrent,
                   shortconv_l_cache=d_conv, ssm_k_heads=k_heads, ssm_v_heads=v_heads,
                   ssm_head_dim=head, attn_gated=True, has_qk_norm=True, qkv_fused=False,
                   ffn_norm_name="post_attention_norm")


def _mrope(hp: HParams, keys: _Keys) -> HParams:
    """Qwen3-VL's text model (`llama_model_qwen3vl`): its rope sections (four, padded) and
    deepstack layers, each of those layers' outputs plus a block of the given rows."""
    path = keys.f.path
    sections = keys.f.metadata.get(f"{keys.arch}.rope.dimension_sections")
    if sections is None:
        raise GGUFError(path, f"{keys.arch}.rope.dimension_sections is missing")
    secs = tuple(int(s) for s in [*list(sections), 0, 0, 0, 0][:4])
    if hp.rope_dim != hp.head_dim or sum(secs) * 2 > hp.rope_dim or sum(secs) < 1:
        raise GGUFError(path, f"rope sections {list(secs)} do not fit the {hp.rope_dim} rotated "
                              f"dims of heads of {hp.head_dim}")
    n_deepstack = keys.get_int("n_deepstack_layers", 0, allow_zero=True)
    if n_deepstack >= hp.n_layer:
        raise ModelError(f"{path}: {n_deepstack} deepstack layers of {hp.n_layer} leave no layer "
                         "after them")
    return replace(hp, rope_sections=secs, n_deepstack=n_deepstack)
