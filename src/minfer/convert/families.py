"""The architecture families `minfer convert` knows: names, hyper-parameters, tensor fixes.

BERT (`BertModel` and its masked-LM / sequence-classification heads: sentence-transformers
folders) is converted as llama.cpp's `BertModel` does: `bert.` prefixes dropped, the MLM / NSP
heads and the pooler left out, a labelled classifier as `cls.output`, not causal, the pooling
from the folder's `modules.json` / `1_Pooling/config.json`, positions and token types kept f32.

One `Family` per llama.cpp architecture: which Hugging Face `architectures` map to it, the
family-specific metadata written after the common keys, and the per-tensor fix-ups llama.cpp's
converter applies — Llama's (and SmolLM3's) Q/K row permutation (HF stores rotary halves; GGUF
wants interleaved pairs), Gemma 3's RMSNorm weights stored as w-1 (+1 on every `*norm.weight`)
and its embedding trimmed to the real vocabulary. Extra tensors (Llama 3's `rope_freqs`,
Phi-3's LongRoPE `rope_factors_long` / `_short`) are generated here too. Phi-3 writes its
hyper-parameters in its own order (`Family.hparams`), its LongRoPE magnitude first of all
(`Family.first_kv`), as llama.cpp's `Phi3MiniModel` does; its fused `qkv_proj` and
`gate_up_proj` keep their layout (`attn_qkv`, `ffn_up`).

The mixtures of experts (Qwen2-MoE with its gated shared expert, Qwen3-MoE, and Mixtral written
as a `llama` file) store one matrix per expert and projection; `Experts` says how to find them
and what the stacked `ffn_{gate,up,down}_exps` tensor is called before the name map.

LFM2 (`Lfm2ForCausalLM`) is rewritten first as llama.cpp's `LFM2Model` rewrites it
(`Family.prepare`: the K/V head count per layer, 0 in the short-convolution layers), its FFN
width auto-adjusted, its convolution taps squeezed to 2-D (`Family.squeezed`).

Qwen3.5 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` with per-expert tensors) is fixed up as
llama.cpp's `Qwen3_5TextModel` / `Qwen3_5MoeTextModel` do with `--no-mtp` (MTP blocks are not
written): the Gated DeltaNet's value heads tiled over its key heads, A = -exp(A_log), the
RMSNorms as 1 + w, the step bias renamed, the conv taps squeezed to 2-D.

A Qwen3 checkpoint that is a Qwen3-Reranker (`qwen3_reranker`: llama.cpp's tests, the README's
title, the folder's or the config's name, a sequence-classification architecture) is written as
llama.cpp writes one: rank pooling, the labels "yes" / "no", the `rerank` prompt template, and
the head `cls.output` (the output projection's "yes" and "no" rows; an untied projection is not
written itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from minfer.convert.checkpoint import CheckpointError

Config = dict[str, Any]


def find(cfg: Config, keys: tuple[str, ...]) -> Any:
    """The value of the first of `keys` the config has (llama.cpp's `find_hparam`), or None."""
    return next((cfg[k] for k in keys if k in cfg), None)


def rope_params(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention, sliding-attention) rope settings from any config spelling: transformers
    5's `rope_parameters` (per attention kind or not) or 4's `rope_scaling` beside `rope_theta`,
    `rope_local_base_freq` and the like, gathered as llama.cpp's `TextModel` gathers them."""
    rp: dict[str, Any] = {**(cfg.get("rope_parameters", cfg.get("rope_scaling")) or {})}
    if "full_attention" not in rp and "sliding_attention" not in rp:
        local = find(cfg, ("local_rope_theta", "rope_local_theta", "rope_theta_local",
                           "swa_rope_theta", "rope_local_base_freq"))
        if local is not None:
            rp["sliding_attention"] = {"rope_theta": local}
        theta = find(cfg, ("global_rope_theta", "rope_global_theta", "rope_theta_global",
                           "rope_theta", "rotary_emb_base"))
        if "rope_theta" not in rp and theta is not None:
            rp["rope_theta"] = theta
        if "rope_type" not in rp and rp.get("type") is not None:
            rp["rope_type"] = rp["type"]
        partial = find(cfg, ("partial_rotary_factor", "rope_pct", "rope_percent"))
        if "partial_rotary_factor" not in rp and partial is not None:
            rp["partial_rotary_factor"] = partial
        orig = cfg.get("original_max_position_embeddings")
        if "original_max_position_embeddings" not in rp and orig is not None:
            rp["original_max_position_embeddings"] = orig
    full: dict[str, Any] = rp.get("full_attention", rp)
    swa: dict[str, Any] = rp.get("sliding_attention", {})
    return full, swa


def head_dim(cfg: Config) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half Q/K rows → GGUF's interleaved pairs, per head (llama.cpp's permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama_fix(name: str, w: np.ndarray, cfg: Config) -> np.ndarray:
    n_head = int(cfg["num_attention_heads"])
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute_rope(w, n_head)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute_rope(w, int(cfg.get("num_key_value_heads") or n_head))
    return w


def _gemma3_fix(name: str, w: np.ndarray, cfg: Config) -> np.ndarray:
    if name.endswith("norm.weight"):  # Gemma3RMSNorm computes x * (1 + w)
        return w + np.float32(1.0)
    return w


def _llama_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_rope_dimension_count(head_dim(cfg))


def _gemma3_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        raise CheckpointError("attn_logit_softcapping is set, which Gemma 3 does not use")
    if cap := cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cap)
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(int(cfg["sliding_window"]))


def _llama3_rope_freqs(cfg: Config) -> Iterator[tuple[str, np.ndarray]]:
    """Llama 3.1+'s frequency factors as the `rope_freqs.weight` tensor (llama.cpp's rule)."""
    full, _ = rope_params(cfg)
    if str(full.get("rope_type", "")).lower() != "llama3":
        return
    base, dim = float(full.get("rope_theta", 10000.0)), head_dim(cfg)
    factor = full.get("factor", 8.0)
    low, high = full.get("low_freq_factor", 1.0), full.get("high_freq_factor", 4.0)
    old_ctx = full.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    yield "rope_freqs.weight", np.array(factors, dtype=np.float32)


def _phi3_rope(cfg: Config) -> tuple[dict[str, Any], int, int]:
    """Phi-3's rope settings as llama.cpp's converter reads them: the rope parameters, the
    rotary dims (partial_rotary_factor of the heads' width) and the original context."""
    full, _ = rope_params(cfg)
    n_embd, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    rot_pct: float = full.get("partial_rotary_factor") or cfg.get("partial_rotary_factor", 1.0)
    orig = full.get("original_max_position_embeddings",
                    cfg.get("original_max_position_embeddings"))
    if orig is None:
        raise CheckpointError("a Phi-3 config needs original_max_position_embeddings")
    return full, int(rot_pct * n_embd) // n_head, int(orig)


def _phi3_hparams(w: gguf.GGUFWriter, cfg: Config, ftype: gguf.LlamaFileType) -> None:
    """Phi3MiniModel.set_gguf_parameters: its keys in its order (0: no sliding window)."""
    full, rope_dims, orig = _phi3_rope(cfg)
    if "rope_theta" not in full:
        raise CheckpointError("a Phi-3 config needs rope_theta")
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(full["rope_theta"])
    w.add_file_type(ftype)
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))


def _phi3_longrope(cfg: Config) -> tuple[list[float], list[float], float] | None:
    """LongRoPE's (long, short) factors and magnitude, None without long factors. The
    magnitude as the converter computes it: sqrt(1 + ln s / ln n_orig) for `longrope` / `su`,
    1 + 0.1 ln s for `yarn` (s = max_position_embeddings / original, 1 when s <= 1)."""
    full, rope_dims, orig = _phi3_rope(cfg)
    long, short = full.get("long_factor"), full.get("short_factor")
    if not long:
        return None
    kind = str(full.get("rope_type", "")).lower()
    scale = int(cfg["max_position_embeddings"]) / orig
    if kind in ("su", "longrope"):
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    elif kind == "yarn":
        attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        raise CheckpointError(f"Phi-3 rope_type {kind!r} is not one minfer converts "
                              "(longrope, su, yarn)")
    if short is None or len(long) != len(short) or len(long) != rope_dims / 2:
        raise CheckpointError(f"LongRoPE's long and short factors must be {rope_dims // 2} long")
    return list(long), list(short), attn


def _phi3_first_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    if (longrope := _phi3_longrope(cfg)) is not None:
        w.add_rope_scaling_attn_factors(longrope[2])


def _phi3_rope_factors(cfg: Config) -> Iterator[tuple[str, np.ndarray]]:
    if (longrope := _phi3_longrope(cfg)) is not None:
        yield "rope_factors_long.weight", np.array(longrope[0], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(longrope[1], dtype=np.float32)


def _no_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    return None


def _no_fix(name: str, w: np.ndarray, cfg: Config) -> np.ndarray:
    return w


def _no_extra(cfg: Config) -> Iterator[tuple[str, np.ndarray]]:
    return iter(())


def _same_config(cfg: Config) -> Config:
    return cfg


def _keep_name(name: str, cfg: Config) -> str | None:
    return name


# BERT: what llama.cpp's converter drops (the MLM / NSP heads, the pooler it does not run)
_BERT_DROPPED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
_BERT_DROPPED_PREFIXES = ("cls.predictions", "cls.seq_relationship")


def bert_labels(cfg: Config) -> list[str] | None:
    """A sequence classifier's output labels (None for AutoConfig's two dummy ones)."""
    labels = cfg.get("id2label")
    if not labels or (len(labels) == 2 and labels.get("0", labels.get(0)) == "LABEL_0"):
        return None
    return [v for _, v in sorted(labels.items(), key=lambda kv: int(kv[0]))]


def _bert_name(name: str, cfg: Config) -> str | None:
    """llama.cpp's renames: no `bert.` prefix, gamma/beta as weight/bias, the classifier of a
    labelled model as the head's output projection; dropped tensors are None."""
    name = name.removeprefix("bert.")
    if name.endswith(".gamma"):
        name = name[:-6] + ".weight"
    if name.endswith(".beta"):
        name = name[:-5] + ".bias"
    if name in _BERT_DROPPED or name.startswith(_BERT_DROPPED_PREFIXES):
        return None
    if bert_labels(cfg) and name in ("classifier.weight", "classifier.bias"):
        name = "classifier.out_proj." + name.rsplit(".", 1)[1]
    return name


def _pooling_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    """A sentence-transformers folder's pooling (Qwen2/Qwen3 embedding models write it too)."""
    pooling = cfg.get("_pooling_type")
    if pooling is not None:
        w.add_pooling_type(pooling)


# llama.cpp's converter's prompt for Qwen3-Reranker (`tokenizer.chat_template.rerank`)
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
    "<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant "
    "passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
RERANK_LABELS = ("yes", "no")  # the head's rows, in this order


def qwen3_reranker(model_dir: Path, cfg: Config) -> bool:
    """Whether a Qwen3 checkpoint is a Qwen3-Reranker, by llama.cpp's converter's tests: its
    README's title, the folder's name, `_name_or_path`, `model_type` or architecture naming
    one, or a sequence-classification architecture."""
    names = ("qwen3-reranker", "qwen3-vl-reranker")
    readme = model_dir / "README.md"
    text = readme.read_text(encoding="utf-8", errors="replace").lower() if readme.is_file() \
        else ""
    if any(f"# {n}" in text for n in names):
        return True
    arch = str((cfg.get("architectures") or [""])[0] or "")
    hints = [model_dir.name, str(cfg.get("_name_or_path", "")), str(cfg.get("model_type", "")),
             arch]
    if any(n in h.lower() for h in hints for n in names):
        return True
    return "sequenceclassification" in arch.lower()


def _qwen3_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    _pooling_kv(w, cfg)
    if cfg.get("_reranker"):
        w.add_classifier_output_labels(list(RERANK_LABELS))
        w.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])


def _bert_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    w.add_causal_attention(False)
    _pooling_kv(w, cfg)
    if labels := bert_labels(cfg):
        w.add_classifier_output_labels(labels)


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts checkpoint stores its experts, one 2-D tensor per expert and
    projection (`model.layers.{bid}.{infix}.{xid}.{proj}.weight`), and the stacked 3-D tensor
    each projection becomes (`merged`, mapped to `ffn_{gate,up,down}_exps`), written as
    llama.cpp writes them: once the layer's last expert tensor is read, projections in `projs`
    order."""

    infix: str
    projs: tuple[str, str, str]
    merged: str  # the stacked tensor's name before the GGUF name map: {bid}, {proj}
    count_keys: tuple[str, ...]  # the config's expert count, first found

    def count(self, cfg: Config) -> int:
        key = next((k for k in self.count_keys if cfg.get(k) is not None), None)
        if key is None:
            raise CheckpointError("the config names no expert count "
                                  f"({', '.join(self.count_keys)})")
        return int(cfg[key])

    def parse(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, projection) of an expert tensor's name; None for any other."""
        head, sep, tail = name.partition(f".{self.infix}.")
        if not sep or not head.rsplit(".", 1)[-1].isdecimal():
            return None
        xid, _, rest = tail.partition(".")
        proj = rest.removesuffix(".weight")
        if not xid.isdecimal() or proj not in self.projs or not rest.endswith(".weight"):
            return None
        return int(head.rsplit(".", 1)[-1]), int(xid), proj


_QWEN_EXPERTS = Experts("mlp.experts", ("down_proj", "gate_proj", "up_proj"),
                        "model.layers.{bid}.mlp.experts.{proj}.weight",
                        ("num_local_experts", "num_experts"))
_MIXTRAL_EXPERTS = Experts("block_sparse_moe.experts", ("w1", "w2", "w3"),
                           "layers.{bid}.feed_forward.experts.{proj}.weight",
                           ("num_local_experts",))


def _qwen_moe_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    """Qwen2MoeModel's keys (Qwen3-MoE's too): the experts' and the shared expert's widths."""
    if (n_ff := cfg.get("moe_intermediate_size")) is not None:
        w.add_expert_feed_forward_length(int(n_ff))
    if (n_ff := cfg.get("shared_expert_intermediate_size")) is not None:
        w.add_expert_shared_feed_forward_length(int(n_ff))


def _lfm2_config(cfg: Config) -> Config:
    """LFM2Model.set_gguf_parameters's first step: the K/V head count per layer, 0 in the
    short-convolution layers."""
    n_kv = cfg["num_key_value_heads"]
    return {**cfg, "num_key_value_heads": [0 if kind == "conv" else n_kv
                                           for kind in cfg["layer_types"]]}


def _lfm2_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    """LFM2Model's keys after the common ones: the vocabulary size, the convolution's cache,
    the norm epsilon and the FFN width (auto-adjusted: 2/3 of it, times the multiplier, rounded
    up to a multiple), the last two overwriting the common keys' values in place."""
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_shortconv_l_cache(int(cfg["conv_L_cache"]))
    w.add_layer_norm_rms_eps(float(cfg["norm_eps"]))
    ff = int(find(cfg, ("block_ff_dim", "intermediate_size")))
    if cfg["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if (mult := cfg.get("block_ffn_dim_multiplier")) is not None:
            ff = int(mult * ff)
        of = int(cfg["block_multiple_of"])
        ff = of * ((ff + of - 1) // of)
    w.add_feed_forward_length(ff)


def reorder_v_heads(w: np.ndarray, axis: int, n_k: int, head: int) -> np.ndarray:
    """Value heads grouped by key head ([k0: v0 v1 .., k1: v0 v1 ..]) → tiled ([k0 v0, k1 v0,
    k0 v1, ..]) along `axis`, each head `head` wide (llama.cpp's `_reorder_v_heads`)."""
    shape = w.shape
    n_per_k = shape[axis] // (n_k * head)
    grouped = w.reshape(*shape[:axis], n_k, n_per_k, head, *shape[axis + 1:])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


# Qwen3.5's Gated DeltaNet tensors whose rows (or columns) hold value heads
_V_HEAD_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight",
                   "in_proj_b.weight", "A_log", "dt_bias", "conv1d.weight", "out_proj.weight")


def _qwen35_fix(name: str, w: np.ndarray, cfg: Config) -> np.ndarray:
    """llama.cpp's `_LinearAttentionVReorderBase` and `Qwen3NextModel` fixes: the value heads
    tiled over the key heads where there are more of them (the q | k rows of `in_proj_qkv`
    and the conv taps kept); A_log as A = -exp(A_log); every RMSNorm but the DeltaNet's gated
    one stored as 1 + w (HF's Qwen3.5 norms compute x * (1 + w))."""
    n_k, n_v = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if ".linear_attn." in name and n_k != n_v and name.endswith(_V_HEAD_TENSORS):
        head = int(cfg["linear_value_head_dim"])
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            w = reorder_v_heads(w, 0, n_k, 1)
        elif name.endswith("out_proj.weight"):
            w = reorder_v_heads(w, 1, n_k, head)
        elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            qk = 2 * n_k * int(cfg["linear_key_head_dim"])
            w = np.concatenate([w[:qk], reorder_v_heads(w[qk:], 0, n_k, head)])
        else:  # in_proj_z
            w = reorder_v_heads(w, 0, n_k, head)
    if name.endswith(".A_log"):
        return -_exp(w)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return w + np.float32(1.0)
    return w


def _exp(w: np.ndarray) -> np.ndarray:
    """exp as llama.cpp's converter computes it (torch's float32 exp, where torch is
    installed: its last bit can differ from a correctly rounded one), else correctly rounded."""
    try:
        import torch
    except ImportError:
        return np.exp(w.astype(np.float64)).astype(np.float32)
    return torch.exp(torch.from_numpy(np.ascontiguousarray(w, np.float32))).numpy()


def _qwen35_name(name: str, cfg: Config) -> str | None:
    """The step bias under the name the GGUF map knows (`dt_proj.bias` → `ssm_dt.bias`); the
    MTP block's tensors (`mtp.*`) left out, as `--no-mtp` leaves them."""
    if name.startswith(("mtp.", "model.mtp.")):
        return None
    return name.removesuffix(".dt_bias") + ".dt_proj.bias" if name.endswith(".dt_bias") \
        else name


_QWEN35_MROPE_DEFAULT = [11, 11, 10, 0]  # llama.cpp's, where rope_parameters names none


def _qwen35_kv(w: gguf.GGUFWriter, cfg: Config) -> None:
    """Qwen3_5TextModel's keys after the common ones: the experts' widths (MoE), the Gated
    DeltaNet's sizes, which layers are recurrent, the full-attention interval, the rotated
    dims (partial_rotary_factor of a head, 0.25 unless given), default MRoPE sections."""
    _qwen_moe_kv(w, cfg)
    w.add_ssm_conv_kernel(int(cfg["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(cfg["linear_key_head_dim"]))
    w.add_ssm_group_count(int(cfg["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(cfg["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(cfg["linear_value_head_dim"]) * int(cfg["linear_num_value_heads"]))
    if (kinds := cfg.get("layer_types")) is not None:
        if len(kinds) != int(cfg["num_hidden_layers"]):
            raise CheckpointError(f"layer_types has {len(kinds)} entries for "
                                  f"{cfg['num_hidden_layers']} layers")
        w.add_array(f"{w.arch}.attention.recurrent_layers",
                    [kind == "linear_attention" for kind in kinds])
    w.add_full_attention_interval(int(cfg.get("full_attention_interval", 4)))
    rope, _ = rope_params(cfg)
    w.add_rope_dimension_count(int(head_dim(cfg) * rope.get("partial_rotary_factor", 0.25)))
    if "mrope_section" not in rope:
        w.add_rope_dimension_sections(_QWEN35_MROPE_DEFAULT)


@dataclass(frozen=True)
class Family:
    arch: gguf.MODEL_ARCH
    hf_archs: tuple[str, ...]
    fix: Callable[[str, np.ndarray, Config], np.ndarray] = _no_fix
    extra_kv: Callable[[gguf.GGUFWriter, Config], None] = _no_kv
    extra_tensors: Callable[[Config], Iterator[tuple[str, np.ndarray]]] = _no_extra
    defaults: dict[str, Any] = field(default_factory=dict)
    trims_embedding: bool = False
    # HF names whose fix mixes rows (so it needs the whole tensor, not row chunks)
    whole_tensor: tuple[str, ...] = ()
    # a checkpoint tensor's name before the GGUF name map (None: not converted)
    rename: Callable[[str, Config], str | None] = _keep_name
    # the family's own hyper-parameter keys in its converter's order (None: the common ones)
    hparams: Callable[[gguf.GGUFWriter, Config, gguf.LlamaFileType], None] | None = None
    first_kv: Callable[[gguf.GGUFWriter, Config], None] = _no_kv  # right after the arch
    llama_vocab: bool = False  # llama.cpp's LlamaModel vocabulary (its add_space_prefix)
    experts: Experts | None = None  # a mixture of experts: how its experts are stacked
    # the config as the family's converter rewrites it before writing its keys
    prepare: Callable[[Config], Config] = _same_config
    # HF names whose size-1 second axis is dropped (a depthwise convolution's taps)
    squeezed: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


_QK_NAMES = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
FAMILIES = (
    Family(gguf.MODEL_ARCH.QWEN2, ("Qwen2ForCausalLM",), extra_kv=_pooling_kv),
    Family(gguf.MODEL_ARCH.QWEN3, ("Qwen3ForCausalLM",), extra_kv=_qwen3_kv),
    Family(gguf.MODEL_ARCH.QWEN2MOE, ("Qwen2MoeForCausalLM",), extra_kv=_qwen_moe_kv,
           experts=_QWEN_EXPERTS),
    Family(gguf.MODEL_ARCH.QWEN3MOE, ("Qwen3MoeForCausalLM",), extra_kv=_qwen_moe_kv,
           experts=_QWEN_EXPERTS),
    Family(gguf.MODEL_ARCH.LLAMA, ("LlamaForCausalLM", "MistralForCausalLM",
                                   "MixtralForCausalLM"), fix=_llama_fix,
           extra_kv=_llama_kv, extra_tensors=_llama3_rope_freqs, whole_tensor=_QK_NAMES,
           llama_vocab=True, experts=_MIXTRAL_EXPERTS),
    Family(gguf.MODEL_ARCH.SMOLLM3, ("SmolLM3ForCausalLM",), fix=_llama_fix,
           extra_kv=_llama_kv, extra_tensors=_llama3_rope_freqs, whole_tensor=_QK_NAMES,
           llama_vocab=True),
    Family(gguf.MODEL_ARCH.PHI3, ("Phi3ForCausalLM",), hparams=_phi3_hparams,
           first_kv=_phi3_first_kv, extra_tensors=_phi3_rope_factors),
    Family(gguf.MODEL_ARCH.GEMMA3, ("Gemma3ForCausalLM",), fix=_gemma3_fix,
           extra_kv=_gemma3_kv, trims_embedding=True,
           defaults={"max_position_embeddings": 131072, "num_attention_heads": 8,
                     "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "head_dim": 256}),
    Family(gguf.MODEL_ARCH.QWEN35, ("Qwen3_5ForCausalLM",), fix=_qwen35_fix,
           extra_kv=_qwen35_kv, rename=_qwen35_name, whole_tensor=_V_HEAD_TENSORS,
           squeezed=("conv1d.weight",)),
    Family(gguf.MODEL_ARCH.QWEN35MOE, ("Qwen3_5MoeForCausalLM",), fix=_qwen35_fix,
           extra_kv=_qwen35_kv, rename=_qwen35_name, whole_tensor=_V_HEAD_TENSORS,
           squeezed=("conv1d.weight",), experts=_QWEN_EXPERTS),
    Family(gguf.MODEL_ARCH.LFM2, ("Lfm2ForCausalLM", "LFM2ForCausalLM"), extra_kv=_lfm2_kv,
           prepare=_lfm2_config, squeezed=("conv.conv.weight",)),
    Family(gguf.MODEL_ARCH.BERT, ("BertModel", "BertForMaskedLM",
                                  "BertForSequenceClassification"),
           extra_kv=_bert_kv, rename=_bert_name),
)


def family_for(cfg: Config) -> Family:
    archs = cfg.get("architectures") or []
    for fam in FAMILIES:
        if any(a in fam.hf_archs for a in archs):
            return fam
    known = ", ".join(a for f in FAMILIES for a in f.hf_archs)
    raise CheckpointError(f"architecture {archs or cfg.get('model_type')!r} is not one minfer "
                          f"converts ({known})")
