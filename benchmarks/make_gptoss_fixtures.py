"""Regenerate tests/fixtures/gptoss/: a tiny random gpt-oss checkpoint converted by llama.cpp,
with transformers' logits on the same token ids.

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python benchmarks/make_gptoss_fixtures.py

(llama.cpp 0.3.36's converter, found as tests/llama_convert.py finds it: $MINFER_LLAMA_CPP_DIR
or the test-data cache.) The model is written with transformers 5.x's `GptOssForCausalLM`
(random weights, seed 0): n_embd 64, 4 query heads over 2 K/V heads of 16, 2 layers (the first
attends through a sliding window of 8 cells, the second globally), 16 experts of width 64 with
4 used per token, YaRN stretching 64 original positions 4x (rope base 150000), norms away from 1,
sinks / router / expert biases drawn at random and the experts' gate|up weights wide enough
(std 0.5) that the clamped SwiGLU's limit of 7 engages. Its tokenizer is a 320-piece
byte-level BPE with GPT-4o's split (the file says `gpt-4o`, as the real one does) and its chat
template gpt-oss's own (tests/fixtures/templates/gpt-oss.jinja).

transformers' YaRN is asked to `truncate` its ramp's ends (floor / ceil), as llama.cpp always
does; the released gpt-oss config says `truncate: false`, a difference llama.cpp (and minfer)
do not follow. The checkpoint's experts are float (the converter would keep MXFP4 blocks as
MXFP4; a float checkpoint converts to f32 or q8_0).

Converted to f32 (`gptoss.gguf`) and q8_0 (`gptoss-q8_0.gguf`); `logits.npz` holds the ids and
transformers' float32 logits (eager attention, which applies the sinks as the reference
computes them) as `hf`, and its float64 ones as `hf64`. The files are committed, so the tests
need neither transformers nor llama.cpp.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gptoss"
IDS = [1, 17, 250, 33, 99, 5, 301, 42, 77, 128, 64, 200, 3, 150, 11, 290, 12, 260, 40, 7]


def _checkpoint(out: Path) -> None:
    import torch
    import transformers as tf
    from tests.hf_tiny import write_bpe_tokenizer

    from minfer.tokenizer.pretok import GPT4O

    out.mkdir(parents=True)
    vocab = write_bpe_tokenizer(out, split=GPT4O)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = (ROOT / "tests" / "fixtures" / "templates" /
                                   "gpt-oss.jinja").read_text()
    config_path.write_text(json.dumps(tok_config, indent=1))
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 64}
    config = tf.GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64,
                             head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, num_local_experts=16, num_experts_per_tok=4,
                             sliding_window=8, max_position_embeddings=256,
                             rope_parameters=rope, rms_norm_eps=1e-5, initializer_range=0.2,
                             tie_word_embeddings=False, bos_token_id=None,
                             eos_token_id=vocab - 1, pad_token_id=vocab - 3)
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from 1, so a wrong norm shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):  # around the scores' size, so the sinks show
                p.copy_(torch.randn_like(p))
            elif name.endswith("gate_up_proj"):  # so |gate|, |up| pass the limit of 7
                p.copy_(0.5 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(out)


def main() -> None:
    import torch
    import transformers as tf
    from tests.llama_convert import reference_convert

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "gpt-oss-tiny"
        _checkpoint(hf)
        reference_convert([(hf, OUT / "gptoss.gguf", "f32", "gpt-4o"),
                           (hf, OUT / "gptoss-q8_0.gguf", "q8_0", "gpt-4o")])
        model = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                        attn_implementation="eager",
                                                        experts_implementation="eager").eval()
        with torch.no_grad():
            hf32 = model(torch.tensor([IDS])).logits[0].numpy()
            hf64 = model.double()(torch.tensor([IDS])).logits[0].numpy()
    np.savez_compressed(OUT / "logits.npz", ids=np.array(IDS, np.int32),
                        hf=hf32.astype(np.float32), hf64=hf64.astype(np.float32))


if __name__ == "__main__":
    main()
