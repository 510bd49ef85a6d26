"""Regenerate tests/fixtures/qwen3vl/: a tiny random Qwen3-VL checkpoint converted by llama.cpp
(text GGUF + `--mmproj`), with transformers' preprocessing, image features, logits and greedy
answers, on text alone and after a generated image.

    PYTHONPATH=$PWD/src MINFER_LLAMA_CPP_DIR=/path/to/llama.cpp \
        .venv/bin/python benchmarks/make_qwen3vl_fixtures.py [--moe]

`--moe` writes tests/fixtures/qwen3vlmoe/ instead: the same with Qwen3VLMoeForConditionalGeneration
(4 experts of 24, 2 per token, converted as `qwen3vlmoe`), its text model only (no mmproj file:
its tower is the same family's). llama.cpp 0.3.36's converter reads the packed experts in
transformers 4.x's layout (`gate_up_proj` [E, n_embd, 2 n_ff], `down_proj` [E, n_ff, n_embd]),
transformers 5.x saves them as linear weights ([E, 2 n_ff, n_embd], [E, n_embd, n_ff]): the
saved checkpoint's experts are transposed to the former before converting.

The checkpoint: Qwen3VLForConditionalGeneration (transformers 5.x). Its vision tower: 2 layers,
width 32, 2 heads (head 16), patch 8, temporal patch 2, spatial merge 2, a 4 x 4 table of
learned positions, deepstack after layer 0, projected to the text width 64. Its text model: 2
layers, width 64, 4 query / 2 KV heads of 16, interleaved M-RoPE sections [3, 3, 2] (every pair
of the 16-wide head takes t, h or w alike in llama.cpp and transformers), rope base 10000. A
byte-level BPE tokenizer holds `<|vision_start|>`, `<|image_pad|>` and `<|vision_end|>`. Norms
and biases are moved away from their defaults. The image processor (Qwen2VLImageProcessorPil):
patch 8, merge 2, min / max pixels as llama.cpp's clip.cpp sets them (8 and 4096 merged tokens).

Written: `mmproj.gguf` and `model.gguf` (f32); `image.png` (64 x 48: already a multiple of
patch x merge, so no resize: an 8 x 6 patch grid, 4 x 3 merged tokens); `ref.npz`:
`pixels` (transformers' pixel_values, [48, 3 * 2 * 8 * 8], the patches in merge-window order,
each frame twice), `grid` ([1, 6, 8]: t, h, w in patches), `features` (get_image_features'
merger output, [12, 64]), `deepstack` (its deepstack features, [1, 12, 64]), `text_ids` /
`text_logits` / `text_greedy` (a text-only chat prompt: every position's float32 logits and 8
greedy tokens), `ids` (the chat prompt with the image laid out as mtmd lays it out:
`<|vision_start|>`, a `<|image_pad|>` per merged token, `<|vision_end|>`), `positions`
(transformers' get_rope_index: [3, len(ids)] t / h / w), `logits` and `greedy` after the image,
`decode_logits` (the logits each greedy draw was made from, [8, vocab]: the decode steps' rope
positions past the image's). With llama-cpp-python importable here or in `$MINFER_REF_PYTHON`,
also `llamacpp.npz`: llama.cpp's mtmd over the same files and image (`tests/mtmd_ref.py`): the
prompt's ids (-1 at the image tokens), the n_past it leaves, 8 greedy tokens and their logits.
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

MOE = "--moe" in sys.argv[1:]
OUT = ROOT / "tests" / "fixtures" / ("qwen3vlmoe" if MOE else "qwen3vl")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>"]
TEXT = ("The quick brown fox jumps over the lazy dog\n\nHello world! What is in the image?\n"
        "In the morning there is nothing better than tea and a good book\n\n") * 20
PATCH, MERGE = 8, 2
MIN_PIXELS, MAX_PIXELS = 8 * (PATCH * MERGE) ** 2, 4096 * (PATCH * MERGE) ** 2


def _tokenizer(out: Path) -> int:
    return write_bpe_tokenizer(out, specials=SPECIALS, text=TEXT)


def _experts_as_v4(hf: Path) -> None:
    """The packed experts in transformers 4.x's layout (what llama.cpp's converter reads)."""
    from safetensors.torch import load_file, save_file

    for path in hf.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in tensors:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})


def _image() -> object:
    from PIL import Image

    rng = np.random.default_rng(2)
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 3, y * 5, (x + y) * 2], -1) + rng.integers(0, 50, (48, 64, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


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
        vs, ve, pad = (tok.convert_tokens_to_ids(t) for t in SPECIALS[3:])
        text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
                    tie_word_embeddings=False)
        if MOE:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                        decoder_sparse_step=1)
        vis = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                   patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE,
                   num_position_embeddings=16, out_hidden_size=64,
                   deepstack_visual_indexes=[0])
        config_cls = tf.Qwen3VLMoeConfig if MOE else tf.Qwen3VLConfig
        cfg = config_cls(text_config=text, vision_config=vis, image_token_id=pad,
                               vision_start_token_id=vs, vision_end_token_id=ve,
                               tie_word_embeddings=False)
        torch.manual_seed(0)
        model_cls = (tf.Qwen3VLMoeForConditionalGeneration if MOE
                     else tf.Qwen3VLForConditionalGeneration)
        model = model_cls(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith(".weight"):
                    p.copy_(torch.randn_like(p) * 0.1 + 1.0)
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                if "pos_embed" in name:
                    p.copy_(torch.randn_like(p))
        model.save_pretrained(hf, safe_serialization=True)
        if MOE:
            _experts_as_v4(hf)
        proc = tf.Qwen2VLImageProcessorPil(
            patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
            image_mean=[0.5, 0.45, 0.4], image_std=[0.25, 0.3, 0.35])
        proc.save_pretrained(hf)
        reference_convert([(hf, OUT / "model.gguf", "f32", "qwen2")])
        image = _image()
        if not MOE:
            reference_convert([(hf, OUT / "mmproj.gguf", "f32", "qwen2")], extra=("--mmproj",))
            image.save(OUT / "image.png")  # type: ignore[attr-defined]
        pix = proc(images=[image], return_tensors="pt")
        pixels, grid = pix["pixel_values"], pix["image_grid_thw"]
        assert grid.tolist() == [[1, 6, 8]], grid
        with torch.no_grad():
            out = model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
        feats = torch.cat(list(out.pooler_output)).float().numpy()
        deep = torch.stack([torch.cat(list(d)) if isinstance(d, list | tuple) else d
                            for d in out.deepstack_features]).float().numpy()

        def chat(content: str) -> str:
            return tok.apply_chat_template([{"role": "user", "content": content}],
                                           chat_template=CHAT_TEMPLATE,
                                           add_generation_prompt=True, tokenize=False)

        def run(ids: list[int], **kw: object) -> tuple[np.ndarray, np.ndarray]:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids]), **kw).logits[0].float().numpy()
                gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8,
                                     do_sample=False, eos_token_id=None, **kw)
            return logits, gen[0, len(ids):].numpy().astype(np.int32)

        text_ids = tok.encode(chat("Hello world! What is in the morning?"),
                              add_special_tokens=False)
        text_logits, text_greedy = run(text_ids)
        before, after = chat("<image>What is in the image?").split("<image>")
        ids = (tok.encode(before, add_special_tokens=False) + [vs] + [pad] * feats.shape[0]
               + [ve] + tok.encode(after, add_special_tokens=False))
        mm = torch.tensor([[int(i == pad) for i in ids]])
        pos, _ = model.model.get_rope_index(torch.tensor([ids]), mm, image_grid_thw=grid)
        logits, greedy = run(ids, pixel_values=pixels, image_grid_thw=grid,
                             mm_token_type_ids=mm)
        assert int(np.argmax(logits[-1])) == int(greedy[0])
        full = ids + greedy[:-1].tolist()  # the logits of every greedy draw, in one forward
        with torch.no_grad():
            decode_logits = model(input_ids=torch.tensor([full]), pixel_values=pixels,
                                  image_grid_thw=grid, mm_token_type_ids=torch.tensor(
                                      [[int(i == pad) for i in full]])).logits[0, len(ids) - 1:]
        np.savez(OUT / "ref.npz", pixels=pixels.numpy().astype(np.float32),
                 grid=grid.numpy().astype(np.int32), features=feats, deepstack=deep,
                 text_ids=np.array(text_ids, np.int32), text_logits=text_logits,
                 text_greedy=text_greedy, ids=np.array(ids, np.int32), logits=logits,
                 greedy=greedy, positions=pos[:, 0].numpy().astype(np.int32),
                 decode_logits=decode_logits.float().numpy())
        if not MOE:
            _llama_cpp(chat("<image>What is in the image?"))


def _llama_cpp(prompt: str) -> None:
    """llama.cpp's mtmd on the fixture, where an interpreter has llama-cpp-python."""
    import pytest
    from tests.mtmd_ref import mtmd_greedy
    from tests.refpython import llama_python

    try:
        python = llama_python()
    except pytest.skip.Exception as exc:
        print(f"llamacpp.npz not written: {exc}")
        return
    ref = mtmd_greedy(python, str(OUT / "model.gguf"), str(OUT / "mmproj.gguf"),
                      str(OUT / "image.png"), prompt, 8)
    np.savez(OUT / "llamacpp.npz", **ref)


if __name__ == "__main__":
    main()
