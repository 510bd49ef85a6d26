"""`convert_hf`: a Hugging Face safetensors checkpoint → one GGUF, streamed tensor by tensor.

The plan (output names, shapes, types) is made from the safetensors headers alone; the GGUF
header, metadata and tensor table are written first, then each tensor is read from its mmap,
fixed up for its family, converted to the output type (`gguf.quants`, the same code llama.cpp's
converter uses) in row chunks and appended — so at most one output tensor plus one 64 MiB
float32 chunk is in memory (a bf16 0.2B checkpoint: peak RSS 0.42 GB vs llama.cpp's 1.08 GB).
Type rule (llama.cpp's): 1-D tensors, `*_norm.weight`, the MoE routers, positions and token
types stay F32; the rest take the output type, Q8_0 falling back to F16 for rows that are not a
multiple of 32. A mixture's experts are stacked on a new first axis, converted one by one.
The hyper-parameters follow llama.cpp's `TextModel.set_gguf_parameters` key by key (a
family's own keys after them, overwriting a common key's value in place as llama.cpp's do). The file
appears by rename only once complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType

from minfer.convert.checkpoint import CheckpointError, SafeTensor, checkpoint_tensors
from minfer.convert.families import (
    RERANK_LABELS,
    Config,
    Experts,
    Family,
    family_for,
    find,
    qwen3_reranker,
    rope_params,
)
from minfer.convert.vocab import Vocab, load_vocab
from minfer.tools.progress import byte_progress

OUTTYPES: dict[str, tuple[QType, LlamaFileType]] = {
    "f32": (QType.F32, LlamaFileType.ALL_F32),
    "f16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (QType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
_SKIP = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
_CHUNK_ELEMS = 1 << 24  # float32 elements converted at a time (64 MiB)


@dataclass(frozen=True)
class Planned:
    """One output tensor: its GGUF name, numpy-order shape, type and where its data comes from."""

    name: str
    shape: tuple[int, ...]
    qtype: QType
    source: SafeTensor | None = None
    generated: np.ndarray | None = None
    rows: tuple[int, ...] | None = None  # only these rows of the source, in this order
    stacked: tuple[SafeTensor, ...] = ()  # a mixture's experts, stacked on a new first axis

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


# kept f32 whatever the output type (llama.cpp's list, of the tensors minfer's families have):
# the routers, positions, token types and the recurrent layers' convolution taps
_KEEP_F32 = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", "position_embd.weight",
             "token_types.weight", ".ssm_conv1d.weight", ".shortconv.conv.weight")


def _out_type(name: str, shape: tuple[int, ...], want: QType) -> QType:
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or name.endswith(_KEEP_F32):
        return QType.F32
    if want == QType.Q8_0 and shape[-1] % 32:
        return QType.F16
    return want


def load_config(model_dir: Path) -> tuple[Family, Config]:
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the model config ({exc})") from None
    family = family_for(raw)
    cfg = family.prepare({**family.defaults, **{k: v for k, v in raw.items() if v is not None}})
    pooling = sentence_pooling(model_dir)
    if pooling is not None:
        cfg["_pooling_type"] = pooling
    if family.arch == gguf.MODEL_ARCH.QWEN3 and qwen3_reranker(model_dir, cfg):
        cfg["_reranker"] = True
        cfg["_pooling_type"] = gguf.PoolingType.RANK
    return family, cfg


_POOLING_MODES = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS,
                  "lasttoken": gguf.PoolingType.LAST}


def sentence_pooling(model_dir: Path) -> gguf.PoolingType | None:
    """A sentence-transformers folder's pooling (its Pooling module's config), as llama.cpp
    reads it; None without one."""
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return None
    try:
        entries = json.loads(modules.read_text(encoding="utf-8"))
        path = next((m["path"] for m in entries if str(m.get("type", "")).endswith("Pooling")),
                    None)
        if path is None:
            return None
        conf = json.loads((model_dir / path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{model_dir}: cannot read the sentence-transformers pooling "
                              f"({exc})") from None
    if conf.get("pooling_mode_mean_tokens"):
        return gguf.PoolingType.MEAN
    if conf.get("pooling_mode_cls_token"):
        return gguf.PoolingType.CLS
    if conf.get("pooling_mode_lasttoken"):
        return gguf.PoolingType.LAST
    if (mode := conf.get("pooling_mode")) in _POOLING_MODES:
        return _POOLING_MODES[mode]
    raise CheckpointError(f"{model_dir / path}: only mean, cls and last-token pooling are "
                          "converted")


def plan_tensors(family: Family, cfg: Config, tensors: list[SafeTensor], vocab: Vocab,
                 want: QType) -> list[Planned]:
    """Every output tensor in order (generated ones first, as llama.cpp writes them)."""
    names = gguf.get_tensor_name_map(family.arch, int(cfg["num_hidden_layers"]))
    plan = [Planned(name, arr.shape, QType.F32, generated=arr)
            for name, arr in family.extra_tensors(cfg)]
    experts: dict[int, dict[tuple[int, str], SafeTensor]] = {}  # layer → its experts so far
    for t in tensors:
        hf_name = family.rename(t.name, cfg)
        if t.name.endswith(_SKIP) or hf_name is None:
            continue
        if family.experts is not None and (where := family.experts.parse(t.name)) is not None:
            bid, xid, proj = where
            layer = experts.setdefault(bid, {})
            layer[xid, proj] = t
            n_expert = family.experts.count(cfg)
            if len(layer) >= 3 * n_expert:  # the layer's last expert: its stacks, as llama.cpp
                plan.extend(_stack_experts(family.experts, names, bid, n_expert,
                                           experts.pop(bid), want))
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"tensor {t.name!r} has no {family.name} GGUF name")
        shape = t.shape
        if t.name.endswith(family.squeezed) and len(shape) > 2 and shape[1] == 1:
            shape = (shape[0], *shape[2:])
        if family.trims_embedding and name == "token_embd.weight":
            shape = (min(shape[0], vocab.n_tokens), *shape[1:])
        head = "token_embd.weight" if cfg.get("tie_word_embeddings") else "output.weight"
        if cfg.get("_reranker") and name == head:
            plan.append(_rerank_head(t, vocab, want))
            if name == "output.weight":  # llama.cpp writes the head alone
                continue
        plan.append(Planned(name, shape, _out_type(name, shape, want), source=t))
    if experts:
        left = sorted(t.name for layer in experts.values() for t in layer.values())
        raise CheckpointError(f"experts missing beside {left[:3]} (the config says "
                              f"{family.experts and family.experts.count(cfg)} per layer)")
    return plan


def _stack_experts(layout: Experts, names: gguf.TensorNameMap, bid: int, n_expert: int,
                   layer: dict[tuple[int, str], SafeTensor], want: QType) -> list[Planned]:
    """One layer's experts as `ffn_{gate,up,down}_exps`: each projection's n_expert matrices
    stacked on a new first axis, in the layout's projection order."""
    out = []
    for proj in layout.projs:
        try:
            parts = tuple(layer[xid, proj] for xid in range(n_expert))
        except KeyError as exc:
            raise CheckpointError(f"layer {bid}: expert {exc.args[0][0]} has no {proj}") from None
        if len({p.shape for p in parts}) != 1:
            raise CheckpointError(f"layer {bid}: the experts' {proj} differ in shape")
        hf_name = layout.merged.format(bid=bid, proj=proj)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"stacked experts {hf_name!r} have no GGUF name")
        shape = (n_expert, *parts[0].shape)
        out.append(Planned(name, shape, _out_type(name, shape, want), stacked=parts))
    return out


def _rerank_head(t: SafeTensor, vocab: Vocab, want: QType) -> Planned:
    """A Qwen3-Reranker's `cls.output`: the rows of the output projection `t` (or the tied
    embedding) for the tokens "yes" and "no"."""
    rows = []
    for label in RERANK_LABELS:
        if label not in vocab.tokens:
            raise CheckpointError(f"a Qwen3-Reranker's vocabulary needs the token {label!r}")
        rows.append(vocab.tokens.index(label))
    shape = (len(rows), *t.shape[1:])
    name = "cls.output.weight"
    return Planned(name, shape, _out_type(name, shape, want), source=t, rows=tuple(rows))


def _write_hparams(w: gguf.GGUFWriter, family: Family, cfg: Config, ftype: LlamaFileType) -> None:
    if family.hparams is not None:
        family.hparams(w, cfg, ftype)
        family.extra_kv(w, cfg)
        return
    w.add_block_count(int(cfg["num_hidden_layers"]))
    for keys, add in _COMMON_KEYS:
        if (value := find(cfg, keys)) is not None:
            add(w, value)
    if cfg.get("is_causal") is False:
        w.add_causal_attention(False)
    _write_rope(w, family, cfg)
    for keys, add in _NORM_AND_EXPERT_KEYS:
        if (value := find(cfg, keys)) is not None:
            add(w, value)
    if (score := find(cfg, _SCORE_FUNC_KEYS)) is not None:
        if score not in _GATING:
            raise CheckpointError(f"expert score function {score!r} is not one minfer converts "
                                  f"({', '.join(_GATING)})")
        w.add_expert_gating_func(_GATING[score])
    if cfg.get("head_dim") is not None:
        w.add_key_length(int(cfg["head_dim"]))
        w.add_value_length(int(cfg["head_dim"]))
    w.add_file_type(ftype)
    family.extra_kv(w, cfg)


_Add = Callable[[gguf.GGUFWriter, Any], None]
# TextModel.set_gguf_parameters's keys in its order, each from the first config key it finds
_COMMON_KEYS: tuple[tuple[tuple[str, ...], _Add], ...] = (
    (("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
      "model_max_length"), lambda w, v: w.add_context_length(int(v))),
    (("hidden_size", "n_embd", "dim"), lambda w, v: w.add_embedding_length(int(v))),
    (("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
      "n_inner", "hidden_dim"), lambda w, v: w.add_feed_forward_length(int(v))),
    (("num_attention_heads", "n_head", "n_heads"), lambda w, v: w.add_head_count(int(v))),
    (("num_key_value_heads", "n_kv_heads"),  # one per layer where the family says so (LFM2)
     lambda w, v: w.add_head_count_kv([int(n) for n in v] if isinstance(v, list) else int(v))),
)
_NORM_AND_EXPERT_KEYS: tuple[tuple[tuple[str, ...], _Add], ...] = (
    (("rms_norm_eps", "norm_eps"), lambda w, v: w.add_layer_norm_rms_eps(float(v))),
    (("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"),
     lambda w, v: w.add_layer_norm_eps(float(v))),
    (("num_local_experts", "num_experts", "n_routed_experts"),
     lambda w, v: w.add_expert_count(int(v))),
    (("num_experts_per_tok", "num_experts_per_token", "top_k_experts"),
     lambda w, v: w.add_expert_used_count(int(v))),
    (("n_group",), lambda w, v: w.add_expert_group_count(int(v))),
    (("topk_group",), lambda w, v: w.add_expert_group_used_count(int(v))),
)
_SCORE_FUNC_KEYS = ("score_function", "scoring_func", "score_func", "moe_router_activation",
                    "moe_router_activation_func", "expert_selection_fn")
_GATING = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
           "softmax": gguf.ExpertGatingFuncType.SOFTMAX}


def _write_rope(w: gguf.GGUFWriter, family: Family, cfg: Config) -> None:
    """The rope scaling and bases, as TextModel.set_gguf_parameters writes them."""
    full, swa = rope_params(cfg)
    kind, factor = full.get("rope_type"), full.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            value = full.get(key, full.get("attn_factor") if key == "attention_factor" else None)
            if value is not None:  # what llama.cpp's converter writes too
                add(value)
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    elif kind not in (None, "default", "llama3", "linear", "yarn"):
        raise CheckpointError(f"rope_type {kind!r} is not one minfer converts "
                              "(default, linear, yarn, llama3, longrope)")
    if (sections := full.get("mrope_section")) is not None:  # padded to 4 (Qwen3.5)
        w.add_rope_dimension_sections([*sections, 0, 0, 0, 0][:4])
    theta = full.get("rope_theta", 1e6 if family.arch == gguf.MODEL_ARCH.GEMMA3 else None)
    if theta is not None:
        w.add_rope_freq_base(theta)
    if (theta_swa := swa.get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(theta_swa)


def parameter_counts(plan: list[Planned]) -> tuple[int, int, int, int]:
    """(total, shared, per-expert, expert count) parameters, as GGUFWriter counts them for
    the size label: a mixture is labelled `{experts}x{shared + one expert's}`."""
    total = shared = expert = expert_sum = n_stacks = 0
    for p in plan:
        size = math.prod(p.shape)
        total += size
        if "_exps." in p.name and len(p.shape) >= 3:
            count = p.shape[-2 if ".bias" in p.name else -3]
            expert += size // count
            expert_sum += count
            n_stacks += 1
        else:
            shared += size
    return total, shared, expert, expert_sum // n_stacks if n_stacks else 0


def _write_metadata(w: gguf.GGUFWriter, model_dir: Path, family: Family, cfg: Config,
                    vocab: Vocab, plan: list[Planned], ftype: LlamaFileType) -> None:
    w.add_type(gguf.GGUFType.MODEL)
    total, shared, expert, n_expert = parameter_counts(plan)
    meta = gguf.Metadata.load(None, model_dir, None, total)
    generation = gguf.Metadata.load_generation_config(model_dir)
    if "penalty_repeat" not in generation and "repetition_penalty" in generation:
        # llama.cpp's gguf-py reads transformers' name too; the index's `gguf` release does not
        meta.sampling_penalty_repeat = generation["repetition_penalty"]
    meta.name = meta.name or model_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    meta.set_gguf_meta_model(w)
    _write_hparams(w, family, cfg, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if family.llama_vocab:
        tok_cfg = model_dir / "tokenizer_config.json"
        if tok_cfg.is_file():
            prefix = json.loads(tok_cfg.read_text(encoding="utf-8")).get("add_prefix_space")
            if prefix is not None:
                w.add_add_space_prefix(prefix)
    vocab.write(w)
    if family.arch == gguf.MODEL_ARCH.GEMMA3 and vocab.kind == "spm":
        w.add_add_space_prefix(False)


def _convert(p: Planned, family: Family, cfg: Config, rows: tuple[int, int]) -> np.ndarray:
    assert p.source is not None
    data = family.fix(p.source.name, p.source.load(rows), cfg).reshape(-1, *p.shape[1:])
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), p.qtype)


def _tensor_data(p: Planned, family: Family, cfg: Config) -> np.ndarray:
    """The output bytes of one tensor. 2-D tensors go through float32 in row chunks (every
    output type here is row-wise), so the float32 copy never exceeds _CHUNK_ELEMS."""
    if p.generated is not None:
        return p.generated
    if p.stacked:  # every output type is row-wise: the experts one by one
        return np.stack([_tensor_data(Planned(p.name, p.shape[1:], p.qtype, source=t), family,
                                      cfg) for t in p.stacked])
    assert p.source is not None
    if p.rows is not None:  # every output type is row-wise: the chosen rows one by one
        return np.concatenate([_convert(p, family, cfg, (r, r + 1)) for r in p.rows])
    n_rows = p.shape[0]  # Gemma's embedding stops at the vocabulary
    if len(p.shape) != 2 or p.source.name.endswith(family.whole_tensor):
        return _convert(p, family, cfg, (0, n_rows))
    step = max(1, _CHUNK_ELEMS // p.shape[1])
    first = _convert(p, family, cfg, (0, min(step, n_rows)))
    out = np.empty((n_rows, *first.shape[1:]), dtype=first.dtype)
    out[: len(first)] = first
    for r0 in range(step, n_rows, step):
        out[r0 : r0 + step] = _convert(p, family, cfg, (r0, min(r0 + step, n_rows)))
    return out


@contextlib.contextmanager
def _partial(out: Path) -> Iterator[Path]:
    partial = out.with_name(out.name + ".partial")
    try:
        yield partial
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)


def convert_hf(model_dir: str | Path, out: str | Path, *, outtype: str = "f16",
               tokenizer_pre: str | None = None, progress: bool = True) -> Path:
    """Convert the checkpoint in model_dir to the GGUF `out`; returns out."""
    model_dir, out = Path(model_dir), Path(out)
    if outtype not in OUTTYPES:
        raise CheckpointError(f"--outtype {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    if out.exists():
        raise CheckpointError(f"{out} already exists; not overwriting it")
    want, ftype = OUTTYPES[outtype]
    family, cfg = load_config(model_dir)
    wordpiece_types = int(cfg.get("type_vocab_size", 1)) if family.arch == gguf.MODEL_ARCH.BERT \
        else 0
    vocab = load_vocab(model_dir, cfg.get("vocab_size"), tokenizer_pre,
                       wordpiece_types=wordpiece_types)
    plan = plan_tensors(family, cfg, checkpoint_tensors(model_dir), vocab, want)
    with _partial(out) as partial:
        w = gguf.GGUFWriter(partial, family.name)
        family.first_kv(w, cfg)
        _write_metadata(w, model_dir, family, cfg, vocab, plan, ftype)
        for p in plan:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(p.nbytes for p in plan)
        with byte_progress(f"convert {model_dir.name}", total, enabled=progress) as advance:
            for p in plan:
                w.write_tensor_data(_tensor_data(p, family, cfg))
                advance(p.nbytes)
        w.close()
    return out


def describe(plan: list[Planned]) -> list[dict[str, Any]]:
    """The plan as plain rows (name, GGUF ne shape, type) for --dry-run style listings."""
    return [{"name": p.name, "ne": list(p.shape[::-1]), "type": p.qtype.name} for p in plan]


def convert_checkpoint(folder: Path, out: Path, outtype: str, tokenizer_pre: str | None) -> Path:
    """`convert_hf` without a progress bar: the store's converter for catalogue entries shipped
    as checkpoints (`minfer pull all-minilm-l6-v2`), quiet but for errors."""
    gguf_log = logging.getLogger("gguf")
    level = gguf_log.level
    gguf_log.setLevel(logging.ERROR)  # the writer's notes on tokens it has no key for
    try:
        return convert_hf(folder, out, outtype=outtype, tokenizer_pre=tokenizer_pre,
                          progress=False)
    finally:
        gguf_log.setLevel(level)
