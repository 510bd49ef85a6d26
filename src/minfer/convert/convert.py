"""`convert_hf`: a Hugging Face safetensors checkpoint → one GGUF, streamed tensor by tensor.

The plan (output names, shapes, types) is made from the safetensors headers alone; the GGUF
header, metadata and tensor table are written first, then each tensor is read from its mmap,
fixed up for its family, converted to the output type (`gguf.quants`, the same code llama.cpp's
converter uses) in row chunks and appended — so at most one output tensor plus one 64 MiB
float32 chunk is in memory (a bf16 0.2B checkpoint: peak RSS 0.42 GB vs llama.cpp's 1.08 GB).
Type rule (llama.cpp's): 1-D tensors and `*_norm.weight` stay F32; the rest take the output
type, Q8_0 falling back to F16 for rows that are not a multiple of 32. The file appears by
rename only once complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
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
    Family,
    family_for,
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

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def _out_type(name: str, shape: tuple[int, ...], want: QType,
              keep_f32: tuple[str, ...] = ()) -> QType:
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or name in keep_f32:
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
    cfg = {**family.defaults, **{k: v for k, v in raw.items() if v is not None}}
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
    for t in tensors:
        hf_name = family.rename(t.name, cfg)
        if t.name.endswith(_SKIP) or hf_name is None:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"tensor {t.name!r} has no {family.name} GGUF name")
        shape = t.shape
        if family.trims_embedding and name == "token_embd.weight":
            shape = (min(shape[0], vocab.n_tokens), *shape[1:])
        head = "token_embd.weight" if cfg.get("tie_word_embeddings") else "output.weight"
        if cfg.get("_reranker") and name == head:
            plan.append(_rerank_head(t, vocab, want))
            if name == "output.weight":  # llama.cpp writes the head alone
                continue
        plan.append(Planned(name, shape, _out_type(name, shape, want, family.keep_f32),
                            source=t))
    return plan


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
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    if cfg.get("num_key_value_heads"):
        w.add_head_count_kv(int(cfg["num_key_value_heads"]))
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
            if full.get(key) is not None:  # what llama.cpp's converter writes too
                add(full[key])
    elif kind not in (None, "default", "llama3"):
        raise CheckpointError(f"rope_type {kind!r} is not one minfer converts "
                              "(default, linear, yarn, llama3)")
    theta = full.get("rope_theta", 1e6 if family.arch == gguf.MODEL_ARCH.GEMMA3 else None)
    if theta is not None:
        w.add_rope_freq_base(theta)
    if (theta_swa := swa.get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(theta_swa)
    if "rms_norm_eps" in cfg:
        w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if "layer_norm_eps" in cfg:
        w.add_layer_norm_eps(float(cfg["layer_norm_eps"]))
    if "head_dim" in cfg:
        w.add_key_length(int(cfg["head_dim"]))
        w.add_value_length(int(cfg["head_dim"]))
    w.add_file_type(ftype)
    family.extra_kv(w, cfg)


def _write_metadata(w: gguf.GGUFWriter, model_dir: Path, family: Family, cfg: Config,
                    vocab: Vocab, plan: list[Planned], ftype: LlamaFileType) -> None:
    w.add_type(gguf.GGUFType.MODEL)
    total = sum(math.prod(p.shape) for p in plan)
    meta = gguf.Metadata.load(None, model_dir, None, total)
    meta.name = meta.name or model_dir.name
    meta.size_label = meta.size_label or gguf.size_label(total, 0, 0, 0)
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
    data = family.fix(p.source.name, p.source.load(rows), cfg)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), p.qtype)


def _tensor_data(p: Planned, family: Family, cfg: Config) -> np.ndarray:
    """The output bytes of one tensor. 2-D tensors go through float32 in row chunks (every
    output type here is row-wise), so the float32 copy never exceeds _CHUNK_ELEMS."""
    if p.generated is not None:
        return p.generated
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
