"""Regenerate tests/fixtures/vision/: a tiny random Gemma 3 vision tower converted by llama.cpp
(`--mmproj`), with transformers' preprocessing and image features of a generated image.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_vision_fixtures.py \
        --convert /path/to/llama.cpp/convert_hf_to_gguf.py --gguf-py /path/to/llama.cpp/gguf-py

The checkpoint: Gemma3ForConditionalGeneration (transformers 5.x) with a SigLIP tower of 2
layers, width 48, image 64 / patch 8 (8 x 8 patches, average-pooled by llama.cpp's default
4 x 4 to `mm_tokens_per_image` 4), norms and biases away from their defaults; its tensors renamed
to the Hub's layout (`vision_tower.vision_model.*`), which llama.cpp's converter reads. The
projection is rounded to f16 first (the converter stores it in f16). Written: `mmproj.gguf`
(f32), `image.png` (48 x 48, square: llama.cpp letterboxes other shapes, transformers
stretches them), and `ref.npz`: `pixels` (Gemma3ImageProcessorPil's [3, 64, 64]) and
`features` (get_image_features, float32, [4, 64]); the text model too (`model.gguf`, f32, its
SentencePiece vocabulary holding Gemma 3's image markers) and `ref_logits.npz`: a prompt's
`ids` with the image between `<start_of_image>` and `<end_of_image>` and transformers'
float32 `logits` of every position.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_tiny import write_spm_tokenizer

MARKERS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vision"


def _image() -> object:
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:48, 0:48]
    rgb = np.stack([x * 5, y * 5, (x + y) * 2], -1) + rng.integers(0, 40, (48, 48, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convert", required=True)
    ap.add_argument("--gguf-py", required=True)
    args = ap.parse_args()
    import torch
    import transformers as tf
    from safetensors.torch import load_file, save_file

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        vocab = write_spm_tokenizer(hf, symbols=MARKERS)
        boi, eoi, img = 3, 4, 5  # MARKERS' ids
        text = tf.Gemma3TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
            query_pre_attn_scalar=32, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
        vis = tf.SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, image_size=64, patch_size=8,
                                    layer_norm_eps=1e-6, vision_use_head=False)
        cfg = tf.Gemma3Config(text_config=text, vision_config=vis, mm_tokens_per_image=4,
                              boi_token_index=boi, eoi_token_index=eoi,
                              image_token_index=img)
        torch.manual_seed(0)
        model = tf.Gemma3ForConditionalGeneration(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    base = 0.0 if "language" in name or "soft_emb" in name else 1.0
                    p.copy_(torch.randn_like(p) * 0.1 + base)
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                if name.endswith("mm_input_projection_weight"):
                    p.copy_((0.2 * torch.randn_like(p)).half().float())  # zeros at init
        model.save_pretrained(hf, safe_serialization=True)
        state = load_file(hf / "model.safetensors")
        hub = {("vision_tower.vision_model." + k[len("vision_tower."):]
                if k.startswith("vision_tower.") else k): v.contiguous() for k, v in state.items()}
        save_file(hub, hf / "model.safetensors", metadata={"format": "pt"})
        proc = tf.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, resample=2,
                                          image_mean=[0.48, 0.45, 0.41],
                                          image_std=[0.27, 0.26, 0.28])
        proc.save_pretrained(hf)
        env = {**os.environ, "PYTHONPATH": args.gguf_py}
        subprocess.run([sys.executable, args.convert, str(hf), "--outfile",
                        str(OUT / "mmproj.gguf"), "--outtype", "f32", "--mmproj"],
                       check=True, env=env)
        subprocess.run([sys.executable, args.convert, str(hf), "--outfile",
                        str(OUT / "model.gguf"), "--outtype", "f32"], check=True, env=env)
        image = _image()
        image.save(OUT / "image.png")  # type: ignore[attr-defined]
        pixels = proc(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            feats = model.get_image_features(pixel_values=pixels)
        feats = getattr(feats, "pooler_output", feats)
        np.savez(OUT / "ref.npz", pixels=pixels[0].numpy().astype(np.float32),
                 features=feats.reshape(-1, 64).numpy().astype(np.float32))
        # a prompt with the image as llama.cpp's mtmd lays it out, its image tokens reading each
        # other both ways (token_type_ids 1: transformers' bidirectional image mask)
        ids = [1, 60, 61, 62, boi, *[img] * 4, eoi, 63, 64, 65]
        types = [int(t == img) for t in ids]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), pixel_values=pixels,
                        token_type_ids=torch.tensor([types]))
        np.savez(OUT / "ref_logits.npz", ids=np.array(ids, np.int32),
                 logits=out.logits[0].float().numpy())


if __name__ == "__main__":
    main()
