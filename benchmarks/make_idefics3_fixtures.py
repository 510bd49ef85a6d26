"""Regenerate tests/fixtures/idefics3/: a tiny random Idefics3 (SmolVLM) checkpoint converted by
llama.cpp (text GGUF + `--mmproj`), with transformers' preprocessing, image features and greedy
answer for a generated image.

    PYTHONPATH=$PWD/src MINFER_LLAMA_CPP_DIR=/path/to/llama.cpp \
        .venv/bin/python benchmarks/make_idefics3_fixtures.py

The checkpoint: Idefics3ForConditionalGeneration (transformers 5.x): a SigLIP tower of 2 layers,
width 48, tile 32 / patch 8 (4 x 4 patches, pixel-shuffled by scale factor 2 into 4 rows of
width 192, projected to the text width 64 by `mm.model.fc`), and a 2-layer Llama text model
(`VLlama3ForCausalLM` in its config, as SmolVLM's, which llama.cpp converts as Llama). Its
byte-level BPE tokenizer holds Idefics3's markers (`<fake_token_around_image>`, `<image>`,
`<global-img>`, `<row_r_col_c>`) and a `\\n\\n` token; the image processor's longest edge is 64,
its tile 32. Norms and biases are moved away from their defaults.

Written: `mmproj.gguf` and `model.gguf` (f32); `image.png` (60 x 40: resized to 64 x 42, then
to the 64 x 64 refined size, 2 x 2 tiles of 32 plus the 32 x 32 overview; llama.cpp's and
transformers' rules agree on this image); `ref.npz`: `pixels` ([5, 3, 32, 32], the tiles
row-major then the overview, Idefics3ImageProcessorPil's), `features` (get_image_features,
float32, [5 * 4, 64]), `ids` (a chat prompt with the image laid out as llama.cpp's mtmd lays it
out: the tiles' markers, rows ending in `\\n`, `\\n\\n<fake_token_around_image><global-img>`
before the overview, a `<image>` placeholder per embedding row), `logits` (transformers' float32
logits of every prompt position with those pixels) and `greedy` (transformers' greedy
`generate`, 8 new tokens).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from hf_tiny import CHAT_TEMPLATE, write_bpe_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "idefics3"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>",
            "<image>", "<global-img>", *[f"<row_{r}_col_{c}>" for r in range(1, 5)
                                       for c in range(1, 5)]]
TEXT = ("The quick brown fox jumps over the lazy dog\n\nHello world! What is in the image?\n"
        "In the morning there is nothing better than tea and a good book\n\n") * 20


def _tokenizer(out: Path) -> int:
    """A byte-level BPE tokenizer (Qwen2's split, `\\n\\n` one token) with Idefics3's markers."""
    from tokenizers import Tokenizer

    n = write_bpe_tokenizer(out, specials=SPECIALS, text=TEXT)
    assert Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("\u010a\u010a") \
        is not None  # "\n\n" (mtmd looks it up)
    return n


def _image() -> object:
    from PIL import Image

    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:40, 0:60]
    rgb = np.stack([x * 4, y * 6, (x + y) * 2], -1) + rng.integers(0, 40, (40, 60, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def _mtmd_ids(tok: object, prompt: str, rows: int, cols: int, per_tile: int) -> list[int]:
    """The prompt's ids with the image (at "<image>" in the text) laid out as mtmd does."""
    enc = tok.encode  # type: ignore[attr-defined]

    def t(s: str) -> list[int]:
        return list(enc(s, add_special_tokens=False))

    image_id = t("<image>")[0]
    before, after = prompt.split("<image>")
    ids = t(before)
    for r in range(rows):
        for c in range(cols):
            ids += t(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>")
            ids += [image_id] * per_tile
        if r != rows - 1:
            ids += t("\n")
    ids += t("\n\n") + t("<fake_token_around_image>") + t("<global-img>")
    ids += [image_id] * per_tile + t("<fake_token_around_image>")
    return ids + t(after)


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
        image_id = tok.convert_tokens_to_ids("<image>")
        text = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=512, rms_norm_eps=1e-5,
                              bos_token_id=0, eos_token_id=2, pad_token_id=0,
                              tie_word_embeddings=False)
        text.architectures = ["VLlama3ForCausalLM"]
        vis = tf.Idefics3VisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, image_size=32, patch_size=8,
                                      layer_norm_eps=1e-6)
        cfg = tf.Idefics3Config(text_config=text.to_dict(), vision_config=vis.to_dict(),
                                scale_factor=2, image_token_id=image_id,
                                tie_word_embeddings=False)
        torch.manual_seed(0)
        model = tf.Idefics3ForConditionalGeneration(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith(".weight"):
                    p.copy_(torch.randn_like(p) * 0.1 + 1.0)
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
        model.save_pretrained(hf, safe_serialization=True)
        proc = tf.Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                            max_image_size={"longest_edge": 32},
                                            image_mean=[0.5, 0.45, 0.4],
                                            image_std=[0.25, 0.3, 0.35])
        proc.save_pretrained(hf)
        reference_convert([(hf, OUT / "model.gguf", "f32", "qwen2")])
        reference_convert([(hf, OUT / "mmproj.gguf", "f32", "qwen2")], extra=("--mmproj",))
        image = _image()
        image.save(OUT / "image.png")  # type: ignore[attr-defined]
        pix = proc(images=[[image]], return_tensors="pt", return_row_col_info=True)
        pixels = pix["pixel_values"]  # [1, 5, 3, 32, 32]
        assert (pix["rows"][0][0], pix["cols"][0][0]) == (2, 2), (pix["rows"], pix["cols"])
        with torch.no_grad():
            feats = model.get_image_features(pixel_values=pixels)
        feats = getattr(feats, "pooler_output", feats)
        if isinstance(feats, list | tuple):
            feats = torch.cat([f.reshape(-1, 64) for f in feats])
        feats = feats.reshape(-1, 64).float().numpy()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "<image>What is in the image?"}],
            chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)
        ids = _mtmd_ids(tok, prompt, 2, 2, 4)
        assert ids.count(image_id) == feats.shape[0]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), pixel_values=pixels)
            gen = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels,
                                 max_new_tokens=8, do_sample=False, eos_token_id=None)
        np.savez(OUT / "ref.npz", pixels=pixels[0].numpy().astype(np.float32), features=feats,
                 ids=np.array(ids, np.int32), logits=out.logits[0].float().numpy(),
                 greedy=gen[0, len(ids):].numpy().astype(np.int32))


if __name__ == "__main__":
    main()
