"""Regenerate tests/fixtures/lfm2vl/: a tiny random LFM2-VL checkpoint converted by llama.cpp
(text GGUF + `--mmproj`), with transformers' preprocessing, image features, logits and greedy
answer after a generated image, and llama.cpp's mtmd over the same files.

    PYTHONPATH=$PWD/src MINFER_LLAMA_CPP_DIR=/path/to/llama.cpp \
        MINFER_REF_PYTHON=/path/to/venv-with-llama-cpp-python/bin/python \
        .venv/bin/python benchmarks/make_lfm2vl_fixtures.py [--mtmd]

(`--mtmd`: only llama.cpp's results, `big.png` and `mtmd.{json,npz}`, from the committed GGUFs.)

The checkpoint: Lfm2VlForConditionalGeneration (transformers 5.x). Its vision tower (SigLIP2
NaFlex): 3 layers (the converter maps the projector's `linear_2` only below the block count),
width 32, 2 heads, patch 16 (llama.cpp's converter reshapes the patch embedding as 16 x 16),
a 16 x 16 table of learned positions (`num_patches` 256: the converter writes `image_size`
256), the tanh GELU; its projector: pixel unshuffle by 2, LayerNorm, a 96-wide biased MLP
with the erf GELU (`projector_hidden_act` "gelu", as LFM2-VL's) to the text width 64. Its text
model: LFM2 (conv | attention | conv | conv, 4 / 2 heads). A byte-level BPE tokenizer holds
`<image>`, `<|image_start|>`, `<|image_end|>`, `<|img_thumbnail|>` and the
`<|img_row_r_col_c|>` markers. Norms and biases are moved away from their defaults. The image
processor's preprocessor_config.json: Lfm2VlImageProcessor's defaults (64 to 256 image tokens,
tiles of 512: clip.cpp's limits), mean / std moved off 0.5; its pixels for the fixture image are
computed as it computes them (`_pixels`: the processor itself needs torchvision).

Written: `mmproj.gguf` and `model.gguf` (f32); `image.png` (320 x 256: already a multiple of
patch x merge within the pixel limits, so no resize: a 20 x 16 patch grid, 10 x 8 merged tokens,
one tile); `ref.npz`: `pixels` (transformers' pixel_values for the image's 320 patches, each
(y, x, channel) as SigLIP2's patchify), `shape` ([16, 20]: its spatial_shapes), `features`
(get_image_features, [80, 64]), `ids` (the chat prompt with the image laid out as mtmd lays it
out: `<|image_start|>`, an `<image>` per row, `<|image_end|>`), `logits` (every prompt
position's float32 logits with the image) and `greedy` (transformers' greedy generate, 8 new
tokens). With llama-cpp-python in `$MINFER_REF_PYTHON` (or importable here), also `mtmd.json`
and `mtmd.npz`: llama.cpp's mtmd (`tests/mtmd_ref.py`, flash attention off) on the same prompt
and on `small.png` (a 150 x 100 image llama.cpp resizes up to 320 x 224 with Pillow's bilinear):
the chunks, the image rows (`embd`, `small_embd`), the greedy tokens and their logits; and on
`big.png` (1000 x 700, low noise: llama.cpp tiles it, a 3 x 2 grid of 512-pixel tiles and a
608 x 416 thumbnail; n_ctx 2048): `big` in mtmd.json (its chunks, n_tokens, greedy, margins),
`big_embd` and `big_logits` in mtmd.npz.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from hf_tiny import CHAT_TEMPLATE, write_bpe_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "lfm2vl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<|image_start|>",
            "<|image_end|>", "<|img_thumbnail|>",
            *[f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]]
TEXT = ("The quick brown fox jumps over the lazy dog\n\nHello world! What is in the image?\n"
        "In the morning there is nothing better than tea and a good book\n\n") * 20
LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]
PROMPT = "<image>What is in the image?"
MEAN, STD = [0.5, 0.45, 0.4], [0.25, 0.3, 0.35]


def _tokenizer(out: Path) -> int:
    return write_bpe_tokenizer(out, specials=SPECIALS, text=TEXT)


def _image(w: int, h: int, seed: int, noise: int = 6) -> object:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 0.8, y * 0.9, (x + y) * 0.4], -1) + rng.integers(0, noise, (h, w, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def _vision_as_published(hf: Path) -> None:
    """The tower's tensors under `model.vision_tower.vision_model.` (the published LFM2-VL
    checkpoints' names, which llama.cpp's converter maps; transformers 5.x saves them without
    `vision_model.` and reads both)."""
    from safetensors.torch import load_file, save_file

    for path in hf.glob("*.safetensors"):
        tensors = load_file(str(path))
        renamed = {k.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1): v
                   for k, v in tensors.items()}
        save_file(renamed, str(path), metadata={"format": "pt"})


def _pixels(image: object) -> dict[str, object]:
    """Lfm2VlImageProcessor's output for an image it does not resize (aligned, within the
    pixel limits) nor tile, computed here as it computes it (the processor needs torchvision):
    the fused rescale-and-normalize (x - 255 mean) / (255 std) in float32, patches row-major,
    each patch's pixels (y, x, channel), no padding."""
    import torch

    x = torch.from_numpy(np.asarray(image, np.uint8).copy()).permute(2, 0, 1)[None].float()
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255
    x = (x - mean) / std
    _, c, h, w = x.shape
    rows = x.reshape(1, c, h // 16, 16, w // 16, 16).permute(0, 2, 4, 3, 5, 1)
    rows = rows.reshape(1, (h // 16) * (w // 16), -1)
    return {"pixel_values": rows, "spatial_shapes": torch.tensor([[h // 16, w // 16]]),
            "pixel_attention_mask": torch.ones(1, rows.shape[1], dtype=torch.bool)}


def main() -> None:
    import torch
    import transformers as tf

    from llama_convert import reference_convert

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        vocab = _tokenizer(hf)
        tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"))
        image_id, start, end = (tok.convert_tokens_to_ids(t) for t in SPECIALS[3:6])
        text = tf.Lfm2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5,
                             conv_L_cache=3, block_auto_adjust_ff_dim=False,
                             layer_types=LAYER_TYPES, tie_word_embeddings=True,
                             initializer_range=0.2, bos_token_id=None, eos_token_id=2,
                             pad_token_id=0)
        text.architectures = ["Lfm2ForCausalLM"]  # how llama.cpp's converter finds the text
        vis = tf.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, patch_size=16, num_patches=256,
                                     layer_norm_eps=1e-6, vision_use_head=False)
        cfg = tf.Lfm2VlConfig(text_config=text.to_dict(), vision_config=vis.to_dict(),
                              image_token_id=image_id, projector_hidden_size=96,
                              downsample_factor=2, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = tf.Lfm2VlForConditionalGeneration(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith(".weight"):
                    p.copy_(torch.randn_like(p) * 0.1 + 1.0)
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                if "position_embedding" in name:
                    p.copy_(torch.randn_like(p))
        model.save_pretrained(hf, safe_serialization=True)
        _vision_as_published(hf)
        (hf / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Lfm2VlImageProcessor", "image_mean": MEAN,
            "image_std": STD, "downsample_factor": 2, "encoder_patch_size": 16,
            "min_image_tokens": 64, "max_image_tokens": 256, "tile_size": 512}))
        reference_convert([(hf, OUT / "model.gguf", "f32", "qwen2")])
        reference_convert([(hf, OUT / "mmproj.gguf", "f32", "qwen2")], extra=("--mmproj",))
        image = _image(320, 256, 4)
        image.save(OUT / "image.png")  # type: ignore[attr-defined]
        _image(150, 100, 5).save(OUT / "small.png")  # type: ignore[attr-defined]
        _image(1000, 700, 6, noise=2).save(OUT / "big.png")  # type: ignore[attr-defined]
        pix = _pixels(image)
        shape = pix["spatial_shapes"]
        n = 16 * 20
        with torch.no_grad():
            out = model.get_image_features(pixel_values=pix["pixel_values"],
                                           spatial_shapes=shape,
                                           pixel_attention_mask=pix["pixel_attention_mask"])
        feats = torch.cat(list(out.pooler_output)).float().numpy()
        assert feats.shape == (80, 64), feats.shape
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                         chat_template=CHAT_TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
        before, after = prompt.split("<image>")
        ids = (tok.encode(before, add_special_tokens=False) + [start]
               + [image_id] * feats.shape[0] + [end] + tok.encode(after, add_special_tokens=False))
        kw = dict(pixel_values=pix["pixel_values"], spatial_shapes=shape,
                  pixel_attention_mask=pix["pixel_attention_mask"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), **kw).logits[0].float().numpy()
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8,
                                 do_sample=False, eos_token_id=None, **kw)
        pixels = pix["pixel_values"][0, :n].numpy().astype(np.float32)  # type: ignore[index]
        np.savez_compressed(OUT / "ref.npz", pixels=pixels,
                            shape=shape[0].numpy().astype(np.int32),  # type: ignore[index]
                            features=feats, ids=np.array(ids, np.int32), logits=logits,
                            greedy=gen[0, len(ids):].numpy().astype(np.int32))
        _llama_cpp(prompt)


def _llama_cpp(prompt: str) -> None:
    """llama.cpp's mtmd on the fixture, where an interpreter has llama-cpp-python."""
    import pytest
    from tests import mtmd_ref
    from tests.refpython import llama_python

    try:
        python = llama_python()
    except pytest.skip.Exception as exc:
        print(f"mtmd.json / mtmd.npz not written: {exc}")
        return
    text = prompt.replace("<image>", "<__media__>")
    with tempfile.TemporaryDirectory() as tmp:
        one, small, big = (Path(tmp) / f"{n}.npz" for n in ("one", "small", "big"))
        ref = mtmd_ref.run(python, OUT / "model.gguf", OUT / "mmproj.gguf", OUT / "image.png",
                           text, one, n_greedy=8)
        ref_small = mtmd_ref.run(python, OUT / "model.gguf", OUT / "mmproj.gguf",
                                 OUT / "small.png", text, small, n_greedy=0)
        ref_big = mtmd_ref.run(python, OUT / "model.gguf", OUT / "mmproj.gguf",
                               OUT / "big.png", text, big, n_greedy=8, n_ctx=2048)
        arrays, arrays_small, arrays_big = np.load(one), np.load(small), np.load(big)
        np.savez(OUT / "mtmd.npz", embd=arrays["embd"], logits=arrays["logits"],
                 small_embd=arrays_small["embd"], big_embd=arrays_big["embd"],
                 big_logits=arrays_big["logits"])
    (OUT / "mtmd.json").write_text(json.dumps({"prompt": text, **ref,
                                               "small_chunks": ref_small["chunks"],
                                               "big": ref_big}, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--mtmd"]:
        if not (OUT / "big.png").exists():
            _image(1000, 700, 6, noise=2).save(OUT / "big.png")  # type: ignore[attr-defined]
        _llama_cpp(json.loads((OUT / "mtmd.json").read_text())["prompt"].replace(
            "<__media__>", "<image>"))
    else:
        main()
