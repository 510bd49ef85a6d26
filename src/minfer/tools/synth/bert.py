"""The synthetic BERT encoder (llama.cpp's layout) and its WordPiece vocabulary."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from .vocab import _TRAIN_TEXT
from .weights import WeightTypes, random_matrix, type_for

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def build_tiny_wordpiece() -> list[str]:
    """A small WordPiece vocabulary in llama.cpp's phantom-space form: BERT's five specials,
    then word-initial pieces (`▁word`, every letter, digit and punctuation mark among them, so
    any ASCII text encodes without [UNK]) and continuation pieces (bare text)."""
    words = sorted({w.lower() for w in re.findall(r"[A-Za-z]+", _TRAIN_TEXT)})
    singles = [c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    punct = list(".,:;!?()[]{}'\"-_=+*/#<>@&%$")
    tails = ["s", "ing", "ed", "er", "ly", "e", "t", "n", "a", "o", "i", *singles]
    pieces = ["\u2581" + t for t in dict.fromkeys([*words, *singles, *punct])]
    return [*BERT_SPECIALS, *pieces, *dict.fromkeys(tails)]


def write_tiny_bert(
    path: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_ff: int = 128,
    weight_types: WeightTypes = QType.F32,
    seed: int = 0,
    n_ctx_train: int = 128,
    pooling: int | None = 1,
    n_token_types: int = 2,
    cls_head: int = 0,
    eps: float = 1e-12,
    omit: Sequence[str] = (),
) -> Path:
    """Write a random-weight BERT encoder GGUF in llama.cpp's layout (`general.architecture =
    bert`, a WordPiece vocabulary from `build_tiny_wordpiece`); return its path.

    `pooling` is the written `bert.pooling_type` (None: no key); `cls_head` > 0 adds a
    classifier head of that many outputs (`cls.weight` / `cls.bias` dense + tanh, then
    `cls.output.*`), as a cross-encoder converted by llama.cpp has. `omit` leaves tensors out
    (a malformed file, for the load errors).
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens = build_tiny_wordpiece()
    w = gguf.GGUFWriter(path, "bert", use_temp_file=True)
    w.add_name("tiny-bert")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(eps)
    w.add_causal_attention(False)
    if pooling is not None:  # any value: a bad one makes a malformed file for the tests
        w.add_uint32("bert.pooling_type", pooling)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_type_count(n_token_types)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in BERT_SPECIALS else 1 for t in tokens])
    w.add_bos_token_id(tokens.index("[CLS]"))
    w.add_sep_token_id(tokens.index("[SEP]"))
    w.add_unk_token_id(tokens.index("[UNK]"))
    w.add_pad_token_id(tokens.index("[PAD]"))
    w.add_mask_token_id(tokens.index("[MASK]"))

    def add(name: str, data: np.ndarray, raw_dtype: QType | None = None) -> None:
        if name not in omit:
            w.add_tensor(name, data, raw_dtype=raw_dtype)

    def matrix(name: str, role: str, n_out: int, n_in: int, std: float = 0.08) -> None:
        add(name, *random_matrix(rng, n_out, n_in, std=std, qtype=type_for(weight_types, role),
                                  name=name))

    def vector(name: str, n: int, *, mean: float, std: float) -> None:
        add(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", "token_embd", len(tokens), n_embd, std=0.5)
    if n_token_types:
        add("token_types.weight",
            (0.5 * rng.standard_normal((n_token_types, n_embd))).astype(np.float32))
    add("position_embd.weight", (0.5 * rng.standard_normal((n_ctx_train, n_embd))).astype(
        np.float32))
    vector("token_embd_norm.weight", n_embd, mean=1.0, std=0.1)
    vector("token_embd_norm.bias", n_embd, mean=0.0, std=0.1)
    for i in range(n_layer):
        blk = f"blk.{i}"
        for proj in ("q", "k", "v"):
            matrix(f"{blk}.attn_{proj}.weight", f"attn_{proj}", n_embd, n_embd)
            vector(f"{blk}.attn_{proj}.bias", n_embd, mean=0.0, std=0.05)
        matrix(f"{blk}.attn_output.weight", "attn_output", n_embd, n_embd)
        vector(f"{blk}.attn_output.bias", n_embd, mean=0.0, std=0.05)
        vector(f"{blk}.attn_output_norm.weight", n_embd, mean=1.0, std=0.1)
        vector(f"{blk}.attn_output_norm.bias", n_embd, mean=0.0, std=0.1)
        matrix(f"{blk}.ffn_up.weight", "ffn_up", n_ff, n_embd)
        vector(f"{blk}.ffn_up.bias", n_ff, mean=0.0, std=0.05)
        matrix(f"{blk}.ffn_down.weight", "ffn_down", n_embd, n_ff)
        vector(f"{blk}.ffn_down.bias", n_embd, mean=0.0, std=0.05)
        vector(f"{blk}.layer_output_norm.weight", n_embd, mean=1.0, std=0.1)
        vector(f"{blk}.layer_output_norm.bias", n_embd, mean=0.0, std=0.1)
    if cls_head:
        matrix("cls.weight", "cls", n_embd, n_embd)
        vector("cls.bias", n_embd, mean=0.0, std=0.05)
        matrix("cls.output.weight", "cls_output", cls_head, n_embd, std=0.3)
        vector("cls.output.bias", cls_head, mean=0.0, std=0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
