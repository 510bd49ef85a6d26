"""Tiny random Hugging Face checkpoints (2 layers, small dims) for the converter's tests.

Each is written the way real ones are: `config.json` and `model.safetensors` by transformers'
`save_pretrained`, plus a tokenizer — a byte-level BPE `tokenizer.json` (Qwen2's split regex,
trained here with the `tokenizers` library) or a SentencePiece `tokenizer.model` (trained here
with `sentencepiece`) — and a `tokenizer_config.json` holding the specials and a chat template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_TEXT = ("The quick brown fox jumps over the lazy dog. Hello world! def main(): return 42\n"
         "In the morning there is nothing better than tea and a good book; 0123456789.\n") * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_bpe_tokenizer(out: Path, vocab_size: int = 320, split: str = QWEN2_SPLIT,
                        tokenizer_class: str = "PreTrainedTokenizerFast",
                        post_processor: str | None = None, *,
                        specials: Sequence[str] = SPECIALS, text: str = _TEXT) -> int:
    """A byte-level BPE tokenizer.json + tokenizer_config.json trained on `text`, `specials`
    added; returns the vocabulary size.
    (Phi-4-mini names its class GPT2Tokenizer, which llama.cpp's Phi-3 converter reads as
    BPE.) `post_processor`: None (none), "bytelevel" (Qwen2's: adds nothing) or "bos" (Llama
    3's: ByteLevel, then a template putting the BOS `<|endoftext|>` first)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    tok.add_special_tokens(list(specials))
    bos = specials[0] if post_processor == "bos" else None
    if post_processor is not None:
        steps = [processors.ByteLevel(trim_offsets=False)]
        if bos is not None:
            bos_id = tok.token_to_id(bos)
            steps.append(processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]))
        tok.post_processor = processors.Sequence(steps) if len(steps) > 1 else steps[0]
    tok.save(str(out / "tokenizer.json"))
    n = tok.get_vocab_size()
    decoder = {str(tok.token_to_id(s)): {"content": s, "special": True, "normalized": False,
                                         "lstrip": False, "rstrip": False, "single_word": False}
               for s in specials}
    config = {"tokenizer_class": tokenizer_class, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": bos, "add_bos_token": bos is not None,
              "chat_template": CHAT_TEMPLATE, "added_tokens_decoder": decoder,
              "model_max_length": 512}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return n


def write_spm_tokenizer(out: Path, vocab_size: int = 384, symbols: Sequence[str] = ()) -> int:
    """A SentencePiece tokenizer.model (Llama style: <unk> <s> </s>, byte fallback; `symbols`:
    user-defined tokens, ids 3.. in order)."""
    import sentencepiece as spm

    text = out / "train.txt"
    text.write_text(_TEXT)
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        user_defined_symbols=list(symbols))
    text.unlink()
    (out / "tokenizer.vocab").unlink()
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
              "chat_template": CHAT_TEMPLATE, "model_max_length": 512}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return vocab_size


def _config(family: str, vocab: int) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512,
                                  rms_norm_eps=1e-6, initializer_range=0.08)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6,
                              eos_token_id=vocab - 1), tf.Qwen2ForCausalLM
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False,
                              rope_theta=1e6), tf.Qwen3ForCausalLM
    if family == "qwen3_yarn":  # YaRN stretching 128 trained positions 4x, as Qwen3 gives it
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                "original_max_position_embeddings": 128}
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False,
                              rope_parameters=rope), tf.Qwen3ForCausalLM
    if family == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                              bos_token_id=1, eos_token_id=2), tf.LlamaForCausalLM
    if family == "llama3":  # Llama 3.1 style: BPE tokenizer.json and llama3 rope scaling
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope,
                              eos_token_id=vocab - 1), tf.LlamaForCausalLM
    if family == "smollm3":  # 4 layers: the 4th without RoPE
        return tf.SmolLM3Config(**{**common, "num_hidden_layers": 4}, rope_theta=10000.0,
                                tie_word_embeddings=True, bos_token_id=None,
                                eos_token_id=vocab - 1, pad_token_id=vocab - 3), \
            tf.SmolLM3ForCausalLM
    if family == "phi3":  # Phi-4-mini's layout: partial rotary, GQA, tied output
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        return tf.Phi3Config(**common, original_max_position_embeddings=512,
                             tie_word_embeddings=True, rope_parameters=rope,
                             eos_token_id=vocab - 1, pad_token_id=vocab - 3), \
            tf.Phi3ForCausalLM
    if family == "phi3_longrope":  # Phi-3-mini-128k's: LongRoPE over 256 original positions
        # (llama.cpp pads n_ctx to 256 before it picks the long factors past them)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 256,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]}
        return tf.Phi3Config(**{**common, "max_position_embeddings": 1024},
                             original_max_position_embeddings=256, tie_word_embeddings=False,
                             rope_parameters=rope, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0), tf.Phi3ForCausalLM
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=32, sliding_window=16,
                                   query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0), tf.Gemma3ForCausalLM
    if family == "gemma3_scaled":  # Gemma 3 4B+'s: linear scaling on global layers, local theta
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        return tf.Gemma3TextConfig(**common, head_dim=32, sliding_window=16,
                                   query_pre_attn_scalar=32, rope_parameters=rope,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0), \
            tf.Gemma3ForCausalLM
    if family == "mistral":  # Mistral 7B's: SentencePiece, MistralForCausalLM, no window
        return tf.MistralConfig(**common, head_dim=16, rope_theta=1e6, sliding_window=None,
                                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), \
            tf.MistralForCausalLM
    if family == "tinyllama":  # TinyLlama-style SentencePiece Llama: tied, linear rope scaling
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope,
                              bos_token_id=1, eos_token_id=2), tf.LlamaForCausalLM
    if family == "lfm2":  # LFM2's: short convolutions around one attention layer, FFN width
        # auto-adjusted (2/3, times the multiplier, rounded up to a multiple), tied output
        return tf.Lfm2Config(**{**common, "num_hidden_layers": 4}, norm_eps=1e-5,
                             conv_L_cache=3, block_auto_adjust_ff_dim=True,
                             block_ffn_dim_multiplier=1.5, block_multiple_of=32,
                             layer_types=["conv", "full_attention", "conv", "conv"],
                             tie_word_embeddings=True, bos_token_id=None,
                             eos_token_id=vocab - 1, pad_token_id=vocab - 3), \
            tf.Lfm2ForCausalLM
    q35: dict[str, Any] = dict(
        **{**common, "num_hidden_layers": 4}, head_dim=32, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=vocab - 1)
    if family == "qwen35":  # Qwen3.5's: DeltaNet x 3 | gated attention, interleaved MRoPE
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        return tf.Qwen3_5TextConfig(**q35, rope_parameters=rope), tf.Qwen3_5ForCausalLM
    if family == "qwen35moe":  # its MoE: experts and a gated shared expert, MRoPE by default
        q35.pop("intermediate_size")
        return tf.Qwen3_5MoeTextConfig(**q35, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48), \
            tf.Qwen3_5MoeForCausalLM
    moe: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen2moe":  # Qwen1.5-MoE's: q/k/v biases, a gated shared expert
        return tf.Qwen2MoeConfig(**common, num_experts=4, shared_expert_intermediate_size=48,
                                 tie_word_embeddings=False, rope_theta=1e6,
                                 eos_token_id=vocab - 1, **moe), tf.Qwen2MoeForCausalLM
    if family == "qwen3moe":  # Qwen3-30B-A3B's: q/k norms, renormalised top-k, tied here
        return tf.Qwen3MoeConfig(**common, num_experts=4, head_dim=16, norm_topk_prob=True,
                                 tie_word_embeddings=True, rope_theta=1e6,
                                 eos_token_id=vocab - 1, **moe), tf.Qwen3MoeForCausalLM
    if family == "mixtral":  # Mixtral's: a `llama` file with experts, SentencePiece
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1,
                                eos_token_id=2), tf.MixtralForCausalLM
    raise ValueError(family)


def write_checkpoint(out: Path, family: str, *, seed: int = 0, dtype: str = "float32",
                     post_processor: str | None = None,
                     generation: dict[str, Any] | None = None, legacy: bool = False) -> Path:
    """A random `family` checkpoint with its tokenizer in `out`; returns out. A byte-level
    BPE tokenizer gets `post_processor` (see write_bpe_tokenizer); `generation` is added to
    the generation_config.json transformers writes (sampling defaults, as real ones carry);
    `legacy` rewrites config.json's rope settings the way transformers 4 wrote them (as most
    Hub checkpoints still have them): `rope_theta`, `rope_scaling`, `rope_local_base_freq`."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    spm = family in ("llama", "gemma3", "gemma3_scaled", "phi3_longrope", "mistral", "tinyllama",
                     "mixtral")
    split = LLAMA3_SPLIT if family in ("llama3", "smollm3") else QWEN2_SPLIT
    tok_class = "GPT2Tokenizer" if family == "phi3" else "PreTrainedTokenizerFast"
    vocab = write_spm_tokenizer(out) if spm else write_bpe_tokenizer(
        out, split=split, tokenizer_class=tok_class, post_processor=post_processor)
    config, cls = _config(family, vocab)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random norms, so a wrong norm convention shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if "gemma3" in family else 1.0))
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    if legacy:
        _legacy_rope(out / "config.json")
    if generation:
        path = out / "generation_config.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**saved, **generation}, indent=2))
    return out


def _legacy_rope(path: Path) -> None:
    """config.json's `rope_parameters` as transformers 4 spelled them."""
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    if "sliding_attention" in rope:
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(cfg, indent=2))


def write_reranker_checkpoint(out: Path, *, tied: bool = True, seed: int = 0) -> Path:
    """A random Qwen3-Reranker-shaped checkpoint in `out` (name the folder for it, e.g.
    `qwen3-reranker-tiny`: llama.cpp's converter recognises one by its name): Qwen3ForCausalLM,
    2 layers, n_embd 64, the output tied to the embedding or not, a byte-level BPE tokenizer
    plus "yes" and "no" as tokens (the reranker's head reads their rows)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    write_bpe_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens(["yes", "no"])
    tok.save(str(out / "tokenizer.json"))
    config = tf.Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            rms_norm_eps=1e-6, tie_word_embeddings=tied, rope_theta=1e6,
                            initializer_range=0.2)  # sharp: a wrong row or token shows
    torch.manual_seed(seed)
    model = tf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a wrong norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def hf_logits(ckpt: Path, ids: list[int]) -> Any:
    """transformers' own float32 forward: last-position logits as a numpy array."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def write_bert_checkpoint(out: Path, *, classifier: bool = False, seed: int = 0) -> Path:
    """A random BERT as a sentence-transformers folder (WordPiece tokenizer.json trained here,
    uncased; modules.json with mean pooling), or with `classifier` a one-label cross-encoder
    (`BertForSequenceClassification`, no pooling module); returns out."""
    import torch
    import transformers as tf
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    out.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([_TEXT], trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "unk_token": "[UNK]",
              "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
              "mask_token": "[MASK]", "model_max_length": 128}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    cfg = tf.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=128, type_vocab_size=2, num_labels=1)
    torch.manual_seed(seed)
    model = (tf.BertForSequenceClassification if classifier else tf.BertModel)(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    if not classifier:
        modules = [{"idx": 0, "name": "0", "path": "", "type":
                    "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                    "sentence_transformers.models.Pooling"}]
        (out / "modules.json").write_text(json.dumps(modules))
        (out / "1_Pooling").mkdir(exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    return out


def hf_mean_embeddings(ckpt: Path, texts: list[str]) -> tuple[Any, list[list[int]]]:
    """transformers' float32 BertModel, mean-pooled over each text's tokens (what
    sentence-transformers computes), with the ids its tokenizer gave."""
    import numpy as np
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(ckpt)
    model = tf.BertModel.from_pretrained(ckpt).eval()
    out, ids = [], []
    with torch.no_grad():
        for text in texts:
            enc = tok(text, return_tensors="pt")
            ids.append(enc["input_ids"][0].tolist())
            out.append(model(**enc).last_hidden_state[0].mean(0).numpy())
    return np.stack(out), ids
