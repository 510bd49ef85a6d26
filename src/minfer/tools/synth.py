"""Synthetic GGUF models: random weights, real shapes and a working byte-level BPE tokenizer.

Owns `write_tiny_model` (the model every unit test runs) and `write_model_like_qwen25_05b`
(random weights in the development model's exact shapes and tensor types, for speed tests).
Weights are written with the `gguf` writer; quantized roles go through
`minfer.tools.quantize.simple`.
Block formats need the row length (n_embd for most matrices, n_ff for ffn_down, n_head*head_dim
for attn_output) to be a multiple of the block size: 32 for Q4_0…Q8_0, 256 for the K-quants.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.gguf.parse import StringArray
from minfer.gguf.reader import GGUFFile
from minfer.tools.quantize.simple import can_quantize, quantize

ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
         "ffn_gate", "ffn_up", "ffn_down")
WeightTypes = QType | Mapping[str, QType]  # one type, or role → type ("default" for the rest)

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_TOKENS = ("<tool_call>",)

# Enough English (and a little code) that common pairs such as "th", "in", " the" merge.
_TRAIN_TEXT = """
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs
into the forest. In the morning there is nothing better than a cup of tea and a good book.
She said that the weather would be fine, but then it started to rain in the evening.
Hello world! This is a small test of the tokenizer: it should merge the most common pairs
of letters, such as th, in, er, an, on and the whole word the. We are testing, they are
learning, and everything is running. def main(): return print("hello, world") if x else None
for i in range(10): total = total + i  # counting numbers 0123456789
"""
_PRETOKEN_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable symbol map, in GPT-2's order (printable bytes first)."""
    byte_values = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    code_points = list(byte_values)
    unprintable = [b for b in range(256) if b not in byte_values]
    byte_values += unprintable
    code_points += [256 + i for i in range(len(unprintable))]
    return {b: chr(c) for b, c in zip(byte_values, code_points, strict=True)}


def train_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy byte-level BPE on `text` (ties broken by the smaller pair): deterministic."""
    enc = bytes_to_unicode()
    words = Counter(_PRETOKEN_RE.findall(text))
    seqs = {tuple(enc[b] for b in w.encode()): c for w, c in words.items()}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for seq, count in seqs.items():
            for pair in itertools.pairwise(seq):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        seqs = {_apply_merge(seq, best): c for seq, c in seqs.items()}
    return merges


def _apply_merge(seq: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return tuple(out)


@dataclass(frozen=True)
class TinyVocab:
    """tokens / token_type (1 normal, 3 control, 4 user-defined, 5 unused) / merges."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def build_tiny_vocab(*, n_merges: int = 200, extra_tokens: Sequence[str] = (),
                     vocab_size: int | None = None) -> TinyVocab:
    """256 byte symbols + trained merges + control/user tokens, padded with `[PADn]` if asked."""
    tokens = list(bytes_to_unicode().values())
    merges = train_merges(_TRAIN_TEXT, n_merges)
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    for tok, ttype in [*((t, 3) for t in CONTROL_TOKENS),
                       *((t, 4) for t in (*USER_TOKENS, *extra_tokens))]:
        tokens.append(tok)
        types.append(ttype)
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size={vocab_size} < the {len(tokens)} tokens needed")
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        types += [5] * (vocab_size - len(types))
    return TinyVocab(tokens, types, [f"{a} {b}" for a, b in merges])


def _type_for(weight_types: WeightTypes, role: str) -> QType:
    if isinstance(weight_types, QType):
        return weight_types
    return QType(weight_types.get(role, weight_types.get("default", QType.F32)))


def _random_matrix(rng: np.random.Generator, n_out: int, n_in: int, *, std: float,
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


def write_tiny_model(
    path: str | Path,
    *,
    arch: str = "qwen2",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    head_dim: int | None = None,
    vocab: TinyVocab | None = None,
    weight_types: WeightTypes = QType.F32,
    weight_type: WeightTypes | None = None,
    tied: bool = True,
    seed: int = 0,
    chat_template: str | None = None,
    n_ctx_train: int = 2048,
    rope_base: float = 10000.0,
    extra_tokens: Sequence[str] = (),
    sliding_window: int = 0,
    rope_freqs: bool = False,
    softcaps: tuple[float, float] = (0.0, 0.0),
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_shexp: int = 0,
    router_std: float = 1.0,
) -> Path:
    """Write a random-weight qwen2/qwen3/llama/gemma3 GGUF with a working tokenizer; return its
    path.

    `weight_types` (alias `weight_type`) is one type or a role → type mapping over ROLES (norms
    and biases stay F32). `chat_template=None` writes the ChatML default, "" writes none.
    qwen2 gets q/k/v biases; qwen3 and gemma3 get attn_q_norm / attn_k_norm and no biases;
    gemma3 also its post-attention / post-FFN norms, `sliding_window` (every 6th layer global)
    and `softcaps` = (attention, final logits; 0 = none); llama with `rope_freqs` gets a
    `rope_freqs.weight` of per-pair divisors (Llama 3.1 style). qwen2moe / qwen3moe (the
    attention of qwen2 / qwen3) get `n_expert` experts `n_ff` wide per block, `n_expert_used`
    of them routed per token by an F32 router of std `router_std`, and (qwen2moe, n_ff_shexp >
    0) a shared expert with its sigmoid gate; the experts take the ffn_* roles' types.
    """
    archs = ("qwen2", "qwen3", "llama", "gemma3", "qwen2moe", "qwen3moe")
    if arch not in archs:
        raise ValueError(f"write_tiny_model writes {', '.join(archs)}, not {arch!r}")
    moe = arch.endswith("moe")
    path = Path(path)
    types = weight_type if weight_type is not None else weight_types
    vocab = vocab or build_tiny_vocab(extra_tokens=extra_tokens)
    hd = head_dim or n_embd // n_head
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, use_temp_file=True)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff)
        if n_ff_shexp and arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(n_ff_shexp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if head_dim is not None or arch in ("qwen3", "gemma3", "qwen3moe"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(rope_base)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if softcaps[0]:
        w.add_attn_logit_softcapping(softcaps[0])
    if softcaps[1]:
        w.add_final_logit_softcapping(softcaps[1])
    w.add_layer_norm_rms_eps(1e-6)
    _add_tokenizer(w, vocab, chat_template)

    def matrix(name: str, role: str, n_out: int, n_in: int, std: float = 0.05) -> None:
        data, raw_dtype = _random_matrix(rng, n_out, n_in, std=std, qtype=_type_for(types, role),
                                         name=name)
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    def vector(name: str, n: int, *, mean: float, std: float) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    def experts(name: str, role: str, n_out: int, n_in: int) -> None:
        data, raw_dtype = _random_matrix(rng, n_expert * n_out, n_in, std=0.05,
                                         qtype=_type_for(types, role), name=name)
        w.add_tensor(name, data.reshape(n_expert, n_out, -1), raw_dtype=raw_dtype)

    def ffn(blk: str) -> None:
        if not moe:
            matrix(f"{blk}.ffn_gate.weight", "ffn_gate", n_ff, n_embd)
            matrix(f"{blk}.ffn_up.weight", "ffn_up", n_ff, n_embd)
            matrix(f"{blk}.ffn_down.weight", "ffn_down", n_embd, n_ff)
            return
        w.add_tensor(f"{blk}.ffn_gate_inp.weight",
                     (router_std * rng.standard_normal((n_expert, n_embd))).astype(np.float32))
        experts(f"{blk}.ffn_gate_exps.weight", "ffn_gate", n_ff, n_embd)
        experts(f"{blk}.ffn_up_exps.weight", "ffn_up", n_ff, n_embd)
        experts(f"{blk}.ffn_down_exps.weight", "ffn_down", n_embd, n_ff)
        if n_ff_shexp and arch == "qwen2moe":
            # ne [n_embd, 1], as llama.cpp's converter writes it
            w.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight",
                         (0.3 * rng.standard_normal((1, n_embd))).astype(np.float32))
            matrix(f"{blk}.ffn_gate_shexp.weight", "ffn_gate", n_ff_shexp, n_embd)
            matrix(f"{blk}.ffn_up_shexp.weight", "ffn_up", n_ff_shexp, n_embd)
            matrix(f"{blk}.ffn_down_shexp.weight", "ffn_down", n_embd, n_ff_shexp)

    n_vocab = len(vocab.tokens)
    matrix("token_embd.weight", "token_embd", n_vocab, n_embd, std=0.1)
    for i in range(n_layer):
        blk = f"blk.{i}"
        vector(f"{blk}.attn_norm.weight", n_embd, mean=1.0, std=0.05)
        for proj, n_out in (("q", n_head * hd), ("k", n_head_kv * hd), ("v", n_head_kv * hd)):
            matrix(f"{blk}.attn_{proj}.weight", f"attn_{proj}", n_out, n_embd)
            if arch in ("qwen2", "qwen2moe"):
                vector(f"{blk}.attn_{proj}.bias", n_out, mean=0.0, std=0.02)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            vector(f"{blk}.attn_q_norm.weight", hd, mean=1.0, std=0.05)
            vector(f"{blk}.attn_k_norm.weight", hd, mean=1.0, std=0.05)
        matrix(f"{blk}.attn_output.weight", "attn_output", n_embd, n_head * hd)
        if arch == "gemma3":
            vector(f"{blk}.post_attention_norm.weight", n_embd, mean=1.0, std=0.05)
            vector(f"{blk}.post_ffw_norm.weight", n_embd, mean=1.0, std=0.05)
        vector(f"{blk}.ffn_norm.weight", n_embd, mean=1.0, std=0.05)
        ffn(blk)
    vector("output_norm.weight", n_embd, mean=1.0, std=0.05)
    if rope_freqs:  # divisors growing from 1 to 8 over the pairs, as Llama 3.1's low frequencies
        w.add_tensor("rope_freqs.weight", np.geomspace(1.0, 8.0, hd // 2).astype(np.float32))
    if not tied:
        matrix("output.weight", "output", n_vocab, n_embd, std=0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w: gguf.GGUFWriter, vocab: TinyVocab, chat_template: str | None) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.id("<|im_end|>"))
    w.add_bos_token_id(vocab.id("<|endoftext|>"))
    w.add_pad_token_id(vocab.id("<|endoftext|>"))
    w.add_add_bos_token(False)
    template = DEFAULT_CHAT_TEMPLATE if chat_template is None else chat_template
    if template:
        w.add_chat_template(template)


# The development model's tensor types by role (it alternates ffn_down Q4_K/Q6_K and attn_v
# Q5_0/Q8_0 across layers; one type per role is close enough for speed work).
QWEN25_05B_TYPES: Mapping[str, QType] = {
    "token_embd": QType.Q5_0, "output": QType.Q8_0, "attn_v": QType.Q8_0,
    "ffn_down": QType.Q4_K, "default": QType.Q5_0,
}


def write_model_like_qwen25_05b(path: str | Path, *, weight_type: WeightTypes = QWEN25_05B_TYPES,
                                seed: int = 0) -> Path:
    """Random weights in Qwen2.5-0.5B's shapes (24 layers, 896 wide, vocab 151,936): ~0.5 GB."""
    return write_tiny_model(
        path, arch="qwen2", n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864,
        vocab=build_tiny_vocab(vocab_size=151936), weight_types=weight_type, tied=False,
        seed=seed, n_ctx_train=32768, rope_base=1000000.0,
    )


# Qwen3-30B-A3B's block scaled down (half the width, half the experts, 512-wide experts): 48
# layers x 64 experts, 8 routed per token, Q4_K_M-like types (~2.9 GB, ~0.55 GB read per token)
QWEN3_MOE_BENCH_TYPES: Mapping[str, QType] = {
    "token_embd": QType.Q4_K, "output": QType.Q6_K, "attn_v": QType.Q6_K,
    "ffn_down": QType.Q6_K, "default": QType.Q4_K,
}


def write_moe_like_qwen3_a3b(path: str | Path, *, n_layer: int = 48, n_expert: int = 64,
                             weight_type: WeightTypes = QWEN3_MOE_BENCH_TYPES,
                             seed: int = 0) -> Path:
    """Random weights shaped like a scaled-down Qwen3-30B-A3B (qwen3moe: 1024 wide, 16 / 4
    heads of 128, experts 512 wide, 8 of `n_expert` per token, vocabulary 151,936): the speed
    benchmark's mixture of experts."""
    return write_tiny_model(
        path, arch="qwen3moe", n_layer=n_layer, n_embd=1024, n_head=16, n_head_kv=4,
        head_dim=128, n_ff=512, n_expert=n_expert, n_expert_used=8,
        vocab=build_tiny_vocab(vocab_size=151936), weight_types=weight_type, tied=False,
        seed=seed, n_ctx_train=32768, rope_base=1000000.0, router_std=0.05,
    )


_ARRAY_TYPES = {"b": gguf.GGUFValueType.BOOL, "i": gguf.GGUFValueType.INT32,
                "u": gguf.GGUFValueType.UINT32, "f": gguf.GGUFValueType.FLOAT32}


def _value_type(value: Any) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None, Any]:
    """(type, element type, packable value) for a metadata value as GGUFFile returns it."""
    if isinstance(value, StringArray):
        return gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, value.tolist()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, value
    if isinstance(value, np.ndarray):
        return gguf.GGUFValueType.ARRAY, _ARRAY_TYPES[value.dtype.kind], value.tolist()
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL, None, value
    if isinstance(value, int):
        fits = 0 <= value < 1 << 32
        return (gguf.GGUFValueType.UINT32 if fits else gguf.GGUFValueType.INT64), None, value
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32, None, value
    return gguf.GGUFValueType.STRING, None, str(value)


def copy_gguf(src: str | Path, dst: str | Path, *, metadata: Mapping[str, Any] | None = None,
              drop_tensors: Sequence[str] = ()) -> Path:
    """Rewrite a GGUF with some metadata changed (a value of None drops the key) and some
    tensors left out: for tests that need one specific defect. Integer keys become UINT32
    (INT64 when out of range), floats FLOAT32."""
    changes = dict(metadata or {})
    with GGUFFile.open(src) as f:
        meta = {**f.metadata, **changes}
        w = gguf.GGUFWriter(dst, str(meta.get("general.architecture") or ""))
        w.kv_data[0].clear()  # the writer pre-adds general.architecture; keep meta's order
        for key, value in meta.items():
            if value is None:
                continue
            if key == "general.alignment":
                w.add_custom_alignment(int(value))
                continue
            vtype, sub_type, packable = _value_type(value)
            w.add_key_value(key, packable, vtype, sub_type)
        for name, t in f.tensors.items():
            if name not in drop_tensors:
                byte_shape = (*t.shape[:0:-1], t.row_bytes)  # reversed ne, ne0 in bytes
                w.add_tensor(name, np.array(f.raw(name)).reshape(byte_shape),
                             raw_dtype=QType(t.ggml_type))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(dst)


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
        add(name, *_random_matrix(rng, n_out, n_in, std=std, qtype=_type_for(weight_types, role),
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
