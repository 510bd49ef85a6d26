"""`minfer info [MODEL]`: what a GGUF file holds (hyper-parameters, tokenizer, tensor types).

A vocabulary-only GGUF (no tensors, e.g. llama.cpp's `ggml-vocab-*.gguf`) shows the file and
its tokenizer; hyper-parameters are only read from files that carry weights.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from minfer.gguf.hparams import HParams
from minfer.gguf.parse import StringArray
from minfer.gguf.reader import GGUFFile
from minfer.store.models import model_quantization
from minfer.tools.fetch import resolve


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("info", help="show a model's architecture, tokenizer and tensors")
    p.add_argument("model", nargs="?", help="path to a .gguf or a cached model name "
                                            "(default: the default model)")
    p.add_argument("--metadata", action="store_true", help="also list every metadata key")
    p.add_argument("--backend", choices=("auto", "cpu", "torch"), default=None,
                   help="show which backend would run which ops (default: auto)")
    p.set_defaults(func=run)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _kv_table(title: str, rows: list[tuple[str, object]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, Text(str(value)))
    return table


def _model_rows(f: GGUFFile, hp: HParams) -> list[tuple[str, object]]:
    if not hp.causal:
        return _encoder_rows(f, hp)
    return [
        ("file", f.path), ("file size", f"{human_bytes(f.file_size)} ({f.file_size:,} bytes)"),
        ("GGUF version", f.version), ("name", f.metadata.get("general.name", "-")),
        ("architecture", hp.arch), ("quantization", model_quantization(f)),
        ("layers", hp.n_layer), ("embedding", hp.n_embd),
        ("heads (q / kv)", _heads_text(hp)), ("head dim", _head_dim_text(hp)),
        *_ffn_rows(hp), ("vocabulary", hp.n_vocab),
        ("context length (trained)", hp.n_ctx_train),
        ("rope", _rope_text(hp)),
        ("rms eps", f"{hp.rms_eps:g}"), ("tied embeddings", hp.tie_embeddings),
        ("q/k/v bias", hp.has_qkv_bias), ("q/k norm", hp.has_qk_norm),
        *_fused_rows(hp),
        *_attention_rows(hp),
        *_recurrent_rows(hp),
        *_gemma4_rows(hp),
        ("KV cache per token", _kv_per_token(hp)),
    ]


def _encoder_rows(f: GGUFFile, hp: HParams) -> list[tuple[str, object]]:
    """An encoder (embeddings, reranking): no RoPE, no KV cache; its pooling and head."""
    head = f"dense + tanh, {hp.n_cls_out} outputs" if hp.has_cls_dense else \
        f"{hp.n_cls_out} outputs" if hp.n_cls_out else "none"
    return [
        ("file", f.path), ("file size", f"{human_bytes(f.file_size)} ({f.file_size:,} bytes)"),
        ("GGUF version", f.version), ("name", f.metadata.get("general.name", "-")),
        ("architecture", f"{hp.arch} (encoder: embeddings / reranking)"),
        ("quantization", model_quantization(f)),
        ("layers", hp.n_layer), ("embedding", hp.n_embd),
        ("heads", hp.n_head), ("head dim", hp.head_dim),
        ("feed-forward", hp.n_ff), ("vocabulary", hp.n_vocab),
        ("positions (max input tokens)", hp.n_ctx_train), ("token types", hp.n_token_types),
        ("layer norm eps", f"{hp.rms_eps:g}"), ("pooling", hp.pooling),
        ("classifier head", head),
    ]


def _kv_per_token(hp: HParams) -> str:
    """Bytes per token of context for each cache type (K and V of every layer)."""
    from minfer.backends.cpu.kernels.attn.kv_formats import (
        KV_TYPES,
        QK,
        QUANT_TYPES,
        bytes_per_token,
    )

    # recurrent layers hold no cells, nor do layers reading an earlier layer's (Gemma 4)
    widths = [hp.layer_kv_embd(il) for il in range(hp.n_layer) if not hp.is_recurrent(il)]
    return ", ".join(
        f"{t} {human_bytes(round(sum(bytes_per_token(1, w, t, t) for w in widths)))}"
        for t in KV_TYPES if t not in QUANT_TYPES or min(widths, default=0) % QK == 0)


def _heads_text(hp: HParams) -> str:
    if not hp.layer_kv_heads:
        return f"{hp.n_head} / {hp.n_head_kv}"
    kinds = (("global", False), ("sliding-window", True))
    kv = [(name, {h for il, h in enumerate(hp.layer_kv_heads) if hp.is_swa(il) == swa})
          for name, swa in kinds]
    return f"{hp.n_head} / " + ", ".join(f"{'/'.join(map(str, sorted(hs)))} ({name} layers)"
                                        for name, hs in kv if hs)


def _head_dim_text(hp: HParams) -> str:
    if hp.head_dim_swa and hp.head_dim_swa != hp.head_dim:
        return f"{hp.head_dim} (global layers) / {hp.head_dim_swa} (sliding-window layers)"
    return str(hp.head_dim)


def _gemma4_rows(hp: HParams) -> list[tuple[str, object]]:
    """Gemma 4's extras: per-layer token embeddings, the shared-KV tail, attention scale 1."""
    rows: list[tuple[str, object]] = []
    if hp.n_embd_per_layer:
        rows.append(("per-layer embeddings", f"{hp.n_embd_per_layer} per layer from each token "
                                             "and from the token embedding (gated, projected "
                                             "back after each layer's FFN)"))
    if hp.n_layer_kv:
        sources = ", ".join(f"{il}<-{hp.kv_layer(il)}" for il in range(hp.n_layer_kv, hp.n_layer))
        rows.append(("shared KV", f"the last {hp.n_layer - hp.n_layer_kv} layers attend over an "
                                  f"earlier layer's cells ({sources})"))
    if hp.v_norm:
        v_from_k = [il for il in range(hp.n_layer) if hp.layer_v_from_k(il)]
        shared = f"; V is K's projection in layers {', '.join(map(str, v_from_k))}" \
            if v_from_k else ""
        rows.append(("attention", f"scale {hp.kq_scale:g}, V RMS-normed per head{shared}"))
    if hp.layer_scales:
        rows.append(("layer output scales", " ".join(f"{s:.3g}" for s in hp.layer_scales)))
    return rows


def _vocab_only_rows(f: GGUFFile) -> list[tuple[str, object]]:
    return [
        ("file", f.path), ("file size", f"{human_bytes(f.file_size)} ({f.file_size:,} bytes)"),
        ("GGUF version", f.version), ("name", f.metadata.get("general.name", "-")),
        ("architecture", f.metadata.get("general.architecture", "-")),
        ("contents", "vocabulary only (no tensors)"),
    ]


def _rope_text(hp: HParams) -> str:
    text = f"{hp.rope_style}, base {hp.rope_base:g}, {hp.rope_dim} dims"
    if hp.yarn is not None:
        text += f", YaRN x{hp.yarn.factor:g} over {hp.yarn.n_ctx_orig}"
    elif hp.rope_freq_scale != 1.0:
        text += f", linear scale {hp.rope_freq_scale:g}"
    if hp.has_rope_freqs:
        text += ", rope_freqs factors"
    if hp.longrope_ctx:
        text += (f", LongRoPE (short factors up to a {hp.longrope_ctx}-token context, long "
                 f"past it; attn factor {hp.rope_attn_factor:.4g})")
    elif hp.rope_attn_factor != 1.0:
        text += f", attn factor {hp.rope_attn_factor:.4g}"
    if hp.no_rope_step:
        text += f"; none in every {hp.no_rope_step}th layer (NoPE)"
    if hp.sliding_window:
        dims = f", {hp.rope_dim_swa} dims" if hp.rope_dim_swa != hp.rope_dim else ""
        scaled = ", scaled alike" if hp.rope_freq_scale_swa != 1.0 else ""
        text += f" (sliding-window layers: base {hp.rope_base_swa:g}{dims}{scaled})"
    return text


def _fused_rows(hp: HParams) -> list[tuple[str, object]]:
    """Projections the file stores fused (Phi-3's q|k|v and gate|up), where it does."""
    rows: list[tuple[str, object]] = []
    if hp.qkv_fused:
        rows.append(("attention projection", "fused q|k|v (attn_qkv)"))
    if hp.ffn_up_gate:
        rows.append(("feed-forward projection", "fused gate|up (ffn_up, SwiGLU over its halves)"))
    return rows


def _ffn_rows(hp: HParams) -> list[tuple[str, object]]:
    """The FFN's width; for a mixture of experts its experts and the parameters a token reads."""
    if hp.layer_ff and len(set(hp.layer_ff)) > 1:  # Gemma 4's double-wide shared-KV layers
        wide = [il for il, n in enumerate(hp.layer_ff) if n != hp.n_ff]
        return [("feed-forward", f"{hp.n_ff} ({hp.layer_ff[wide[0]]} in layers {wide[0]}-"
                                 f"{wide[-1]})")]
    if not hp.n_expert:
        return [("feed-forward", hp.n_ff)]
    total, active = hp.n_params()
    beside = f" beside a dense FFN {hp.n_ff} wide" if hp.n_ff_exp else ""  # Gemma 4 26B-A4B
    rows: list[tuple[str, object]] = [
        ("experts", f"{hp.n_expert_used} of {hp.n_expert} per token, each "
                    f"{hp.n_ff_exp or hp.n_ff} wide{beside}"
                    f"{' (weights renormalised)' if hp.expert_norm else ''}")]
    if hp.moe_gating == "softmax_weight":
        rows.append(("routing", "top-k router logits, soft-maxed among themselves"
                                f"{' (router biased)' if hp.moe_bias else ''}"))
    if hp.moe_act == "swiglu_oai":
        rows.append(("expert activation", "clamped SwiGLU (gate <= 7, |up| <= 7, "
                                          "sigmoid(1.702 gate), up + 1)"
                                          f"{', biased experts' if hp.moe_bias else ''}"))
    if hp.n_ff_shexp:
        rows.append(("shared expert", f"{hp.n_ff_shexp} wide, sigmoid-gated"))
    rows.append(("parameters (total / active)",
                 f"{_count(total)} / {_count(active)} per token"))
    return rows


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _recurrent_rows(hp: HParams) -> list[tuple[str, object]]:
    """A hybrid's layer pattern (short convolution or attention, layer by layer) and the
    recurrent state each sequence holds besides its KV cells (f32, every recurrent layer)."""
    if not hp.recurrent:
        return []
    mark, kind = ("D", f"Gated DeltaNet, {hp.ssm_v_heads} value heads of {hp.ssm_head_dim} "
                       f"over {hp.ssm_k_heads} key heads, conv") if hp.ssm_head_dim \
        else ("C", "short conv,")
    pattern = "".join(mark if r else "A" for r in hp.recurrent_layers)
    n_conv = sum(hp.recurrent_layers)
    state = n_conv * hp.state_width * 4
    return [("layer pattern", f"{pattern} ({mark}: {kind} {hp.shortconv_l_cache} taps, "
                              f"{n_conv} layers; A: attention, {hp.n_layer - n_conv} layers)"),
            ("recurrent state per sequence", f"{human_bytes(state)} ({state:,} bytes)")]


def _attention_rows(hp: HParams) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    if hp.sliding_window:
        n_global = hp.swa_layers.count(False)
        rows.append(("sliding window", f"{hp.sliding_window} ({hp.n_layer - n_global} layers; "
                                        f"{n_global} global)"))
    if hp.attn_sinks:
        rows.append(("attention sinks", "a learned logit per head in every softmax"))
    if hp.attn_softcap or hp.final_softcap:
        rows.append(("soft-cap (attn / logits)", f"{hp.attn_softcap:g} / {hp.final_softcap:g}"))
    return rows


def _token(meta: Any, key: str) -> str:
    tid = meta.get(key)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tid, int):
        return "-"
    if isinstance(tokens, StringArray) and 0 <= tid < len(tokens):
        return f"{tid} {tokens[tid]!r}"
    return f"{tid} (out of range)"


def _tokenizer_rows(f: GGUFFile) -> list[tuple[str, object]]:
    meta = f.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    template = meta.get("tokenizer.chat_template")
    return [
        ("model", meta.get("tokenizer.ggml.model", "-")),
        ("pre-tokenizer", meta.get("tokenizer.ggml.pre", "-")),
        ("tokens", len(tokens) if tokens is not None else "-"),
        ("merges", len(merges) if merges is not None else "-"),
        ("bos", _token(meta, "tokenizer.ggml.bos_token_id")),
        ("eos", _token(meta, "tokenizer.ggml.eos_token_id")),
        ("add_bos", meta.get("tokenizer.ggml.add_bos_token", "-")),
        ("add_space_prefix", meta.get("tokenizer.ggml.add_space_prefix", "-")),
        ("chat template", f"yes ({len(template)} chars)" if isinstance(template, str) else "no"),
    ]


def _tensor_table(f: GGUFFile) -> Table:
    table = Table(title="tensors", title_justify="left")
    for col in ("type", "count", "bytes"):
        table.add_column(col, justify="left" if col == "type" else "right")
    nbytes: dict[str, int] = {}
    for t in f.tensors.values():
        nbytes[t.type_name] = nbytes.get(t.type_name, 0) + t.nbytes
    for name, count in f.type_census().items():
        table.add_row(name, str(count), human_bytes(nbytes[name]))
    table.add_row("total", str(len(f.tensors)), human_bytes(sum(nbytes.values())), style="bold")
    return table


def _short(value: object) -> str:
    if isinstance(value, StringArray | np.ndarray):
        first = [value[i] for i in range(min(4, len(value)))]
        head = ", ".join(repr(x.item() if isinstance(x, np.generic) else x) for x in first)
        return f"[{len(value)} items: {head}{', …' if len(value) > 4 else ''}]"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "…"


def _backend_rows(choice: str | None) -> list[tuple[str, object]]:
    """Which backends `--backend choice` selects here, and what each takes."""
    from minfer.backends.select import select_backends

    rows: list[tuple[str, object]] = [("selection", choice or "auto")]
    for backend in select_backends(choice):
        describe = getattr(backend, "describe", None)
        what = describe() if callable(describe) else "every op the others decline"
        rows.append((backend.name, what))
    return rows


def run(args: argparse.Namespace) -> int:
    path = resolve(args.model)
    with GGUFFile.open(path) as f:
        console = Console()
        if not f.tensors:
            console.print(_kv_table("model", _vocab_only_rows(f)))
            console.print(_kv_table("tokenizer", _tokenizer_rows(f)))
        else:
            hp = HParams.from_gguf(f)
            console.print(_kv_table("model", _model_rows(f, hp)))
            console.print(_kv_table("tokenizer", _tokenizer_rows(f)))
            console.print(_tensor_table(f))
        console.print(_kv_table("backends", _backend_rows(args.backend)))
        if args.metadata:
            console.print(_kv_table("metadata", [(k, _short(v)) for k, v in f.metadata.items()]))
    return 0
