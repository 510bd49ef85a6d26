"""Regenerate tests/fixtures/qwen35/: tiny random Qwen3.5 checkpoints (dense and MoE) converted
by llama.cpp, with transformers' float32 logits on the same token ids.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_qwen35_fixtures.py

The model is transformers 5.x's `Qwen3_5ForCausalLM` (random weights, seed 0, n_embd 64, 4
layers: three Gated DeltaNet then one gated full attention, as `full_attention_interval` 4
lays them out; attention 4 heads of 32 over 2 K/V heads, a quarter of each head rotated with
interleaved MRoPE sections [2, 1, 1]; DeltaNet 2 key heads and 4 value heads of 16, so the
converter's V-head reordering shows; conv kernel 4; norms away from their init, untied output)
with the byte-level BPE tokenizer of tests/hf_tiny.py, saved as safetensors, converted by
llama.cpp 0.3.36's `convert_hf_to_gguf.py --outtype f32 --no-mtp` (the checkpoint has no MTP
block), and run on the ids by transformers in float32 (eager attention, the torch recurrence).

The MoE variant is `Qwen3_5MoeForCausalLM` with the same trunk, every FFN 8 experts of 32
(top 2, renormalised) plus a shared expert of 48 behind its sigmoid gate (`qwen35moe.gguf`,
`logits_moe.npz`).

`qwen35_mtp.gguf` / `mtp.npz` and `qwen35moe_mtp.gguf` / `mtp_moe.npz` are the dense and MoE
trunks (seed 7) with one MTP block, converted without --no-mtp, and the head's float64
reference (`make_mtp`).

`qwen35.gguf` and `logits.npz` (keys `hf`: every position's logits, `ids`) are committed, so
the tests need neither transformers nor llama.cpp.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "qwen35"


def main() -> None:
    make(moe=False)
    make(moe=True)
    make_mtp()
    make_mtp(moe=True)


def make(*, moe: bool) -> None:
    import torch
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_tiny import write_bpe_tokenizer
    from llama_convert import reference_convert

    name, npz = ("qwen35moe", "logits_moe.npz") if moe else ("qwen35", "logits.npz")
    model_cls = Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / name
        hf.mkdir()
        vocab = write_bpe_tokenizer(hf)
        common = dict(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=512, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, tie_word_embeddings=False, initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True},
            bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=vocab - 3)
        config = Qwen3_5MoeTextConfig(
            **common, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2) if moe else \
            Qwen3_5TextConfig(**common, intermediate_size=128)
        torch.manual_seed(0)
        model = model_cls(config).eval()
        with torch.no_grad():  # norms, decay and step bias away from their init
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(p + 0.1 * torch.randn_like(p))
                elif pname.endswith(("A_log", "dt_bias")):
                    p.copy_(0.5 * torch.randn_like(p))
        model.save_pretrained(hf)
        reference_convert([(hf, OUT / f"{name}.gguf", "f32", "qwen2")], extra=("--no-mtp",))
        ids = np.random.default_rng(3).integers(0, vocab - 3, 40).tolist()
        model = model_cls.from_pretrained(hf, dtype=torch.float32,
                                          attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
    np.savez_compressed(OUT / npz, hf=logits, ids=np.array(ids, np.int32))


MTP_SEED = 7


def make_mtp(*, moe: bool = False) -> None:
    """`qwen35_mtp.gguf` and `mtp.npz` (MoE: `qwen35moe_mtp.gguf`, `mtp_moe.npz`): the trunk of
    `make`'s shape (seed 7) with one MTP block, converted without --no-mtp, and the MTP head's
    reference on the same ids.

    transformers' `Qwen3_5ForCausalLM` builds no MTP block (it drops `mtp.*` on load), so the
    block's weights are added to the saved safetensors as Qwen3.5's checkpoints store them
    (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`,
    `mtp.layers.0.*`: a full-attention decoder layer, saved by transformers so its names are
    the on-disk ones, the MoE's experts one by one) with `mtp_num_hidden_layers: 1` in the
    config. The reference runs the head as vLLM and llama.cpp do, in float64 with transformers'
    own modules: the trunk's final normed hidden states H; at position q the token's embedding
    and H[q - 1] (zeros at q = 0), each RMS-normed, concatenated (embedding first) and
    projected by `fc`; the block as a one-layer text model on those rows (its causal attention
    over positions 0..q, its final norm `mtp.norm`); the shared LM head. Saved: `ids`, `hidden`
    (H, float32), `hf` (the trunk's logits), `mtp_hidden` (the head's normed output rows),
    `mtp_logits`."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_tiny import write_bpe_tokenizer
    from llama_convert import reference_convert

    name, npz = ("qwen35moe_mtp", "mtp_moe.npz") if moe else ("qwen35_mtp", "mtp.npz")
    config_cls = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / name
        hf.mkdir()
        vocab = write_bpe_tokenizer(hf)
        ffn = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                   num_experts_per_tok=2) if moe else dict(intermediate_size=128)
        config = config_cls(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=512, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, tie_word_embeddings=False, initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True},
            bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=vocab - 3, **ffn)
        torch.manual_seed(MTP_SEED)
        model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config).eval()
        head_cfg = config_cls(**{**config.to_dict(), "num_hidden_layers": 1,
                                 "layer_types": ["full_attention"]})
        # the MTP block as a one-layer model
        head = (Qwen3_5MoeTextModel if moe else Qwen3_5TextModel)(head_cfg).eval()
        fc = torch.nn.Linear(128, 64, bias=False)
        norms = {n: torch.zeros(64) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")}
        with torch.no_grad():
            for module in (model, head, fc):
                for pname, p in module.named_parameters():
                    if "norm" in pname:
                        p.copy_(p + 0.1 * torch.randn_like(p))
                    elif pname.endswith(("A_log", "dt_bias")):
                        p.copy_(0.5 * torch.randn_like(p))
                    elif p.ndim >= 2 and "embed_tokens" not in pname:
                        p.copy_(0.2 * torch.randn_like(p))
            for n in norms:
                norms[n] = 0.1 * torch.randn(64)
        model.save_pretrained(hf)
        head.save_pretrained(Path(tmp) / "head")
        weights = load_file(hf / "model.safetensors")
        weights["mtp.fc.weight"] = fc.weight.detach().clone()
        for n, w in norms.items():
            weights[f"mtp.{n}.weight"] = w.clone()
        for hname, w in load_file(Path(tmp) / "head" / "model.safetensors").items():
            if hname.startswith("layers.0."):
                weights[f"mtp.{hname}"] = w
            elif hname == "norm.weight":
                weights["mtp.norm.weight"] = w
        save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((hf / "config.json").read_text())
        cfg["mtp_num_hidden_layers"] = 1
        (hf / "config.json").write_text(json.dumps(cfg, indent=2))
        reference_convert([(hf, OUT / f"{name}.gguf", "f32", "qwen2")])

        ids = np.random.default_rng(3).integers(0, vocab - 3, 40).tolist()
        model = model.double()
        head = head.double()
        fc = fc.double()
        if moe:  # torch's grouped matmul takes no float64: the experts one by one
            model.set_experts_implementation("eager")
            head.set_experts_implementation("eager")
        with torch.no_grad():
            x = torch.tensor([ids])
            hidden = model.model(x).last_hidden_state  # [1, n, 64]: after the final norm
            logits = model.lm_head(hidden)

            def rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)

            prev = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
            e = rms(model.model.embed_tokens(x), norms["pre_fc_norm_embedding"].double())
            h = rms(prev, norms["pre_fc_norm_hidden"].double())
            rows = fc(torch.cat([e, h], dim=-1))
            mtp_hidden = head(inputs_embeds=rows).last_hidden_state
            mtp_logits = model.lm_head(mtp_hidden)
    np.savez_compressed(OUT / npz, ids=np.array(ids, np.int32),
                        hidden=hidden[0].numpy().astype(np.float32),
                        hf=logits[0].numpy().astype(np.float32),
                        mtp_hidden=mtp_hidden[0].numpy().astype(np.float32),
                        mtp_logits=mtp_logits[0].numpy().astype(np.float32))


if __name__ == "__main__":
    main()
