"""Synthetic mmproj (vision tower) GGUFs: random weights under the exact tensor names, shapes,
types and `clip.*` metadata llama.cpp 0.3.36's converter writes and `tools/mtmd/clip.cpp` reads,
plus a matching one-layer text GGUF (mtmd checks the text model's input width against the
projector's), for speed comparisons against llama.cpp's mtmd on the same files.

- `write_siglip_mmproj`: a Gemma 3 (`gemma3`) SigLIP tower; the defaults are SigLIP-So400m's
  (27 layers, 1152 wide, 16 heads, ff 4304, patch 14) at `image_size` 448 (PaliGemma's 448
  variant; Gemma 3 itself uses 896: pass it), pooled 4 x 4 and projected to Gemma 3 4B's 2560.
- `write_qwen3vl_mmproj`: a Qwen3-VL (`qwen3vl_merger`) tower; the defaults are Qwen3-VL-2B's
  vision_config (depth 24, hidden 1024, 16 heads, intermediate 4096, patch 16, temporal patch 2,
  spatial merge 2, 2304 learned positions, deepstack after layers 5 / 11 / 17, out 2048).
- `write_idefics3_mmproj`: an Idefics3 (`idefics3`, SmolVLM) tower; the defaults are
  SmolVLM-500M's (SigLIP-base: 12 layers, 768 wide, 12 heads, ff 3072, patch 16, 512-pixel
  tiles, pixel shuffle 4, `mm.model.fc` to 960; images up to 2048 on the longest side).
- `write_text_for_mmproj`: a one-layer `gemma3` or `qwen3vl` text model of the projector's
  width (qwen3vl: with `n_deepstack_layers`, its input width (1 + n) times its own).
- `write_text_like_smolvlm_500m`: SmolVLM-500M's text model in full (SmolLM2-360M's llama
  shapes, vocabulary 49,280, Q8_0 as ggml-org's GGUF) with the Idefics3 image markers and the
  one-token `\n\n` mtmd looks up (`IDEFICS3_TOKENS`).

Types as the converter's `--outtype f16` leaves them: the block, merger and projection matrices
in `weight_type` (f16; q8_0 where the rows allow), norms and biases f32; Gemma 3's patch and
position embeddings f32 (its `.embeddings.` rule), Qwen3-VL's patch kernels in f16 and its
position table f32 (clip.cpp resizes it with ggml_interpolate, which reads f32 only).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.gguf.reader import GGUFFile
from minfer.tools.quantize.simple import quantize

from .dense import write_tiny_model
from .edit import copy_gguf
from .vocab import TinyVocab, build_tiny_vocab

IMAGE_MEAN_SIGLIP = (0.5, 0.5, 0.5)
IMAGE_STD_SIGLIP = (0.5, 0.5, 0.5)
# Idefics3's markers as SmolVLM's vocabulary holds them (tiles up to 6 x 6)
IDEFICS3_TOKENS = ("<fake_token_around_image>", "<global-img>", "<image>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


class _Writer:
    """A clip GGUF being written: metadata as the converter names it, tensors by ggml role."""

    def __init__(self, path: Path, projector: str, seed: int, weight_type: QType) -> None:
        self.w = gguf.GGUFWriter(path, "clip", use_temp_file=True)
        self.rng = np.random.default_rng(seed)
        self.weight_type = weight_type
        self.w.add_string("general.type", "mmproj")
        self.w.add_string("general.name", f"synthetic {projector}")
        self.w.add_bool("clip.has_vision_encoder", True)
        self.projector = projector

    def vision(self, *, n_embd: int, n_ff: int, n_layer: int, n_head: int, image_size: int,
               patch: int, n_embd_text: int, mean: Sequence[float], std: Sequence[float],
               eps: float) -> None:
        w = self.w
        w.add_uint32("clip.vision.projection_dim", n_embd_text)
        w.add_uint32("clip.vision.image_size", image_size)
        w.add_uint32("clip.vision.patch_size", patch)
        w.add_uint32("clip.vision.embedding_length", n_embd)
        w.add_uint32("clip.vision.feed_forward_length", n_ff)
        w.add_uint32("clip.vision.block_count", n_layer)
        w.add_uint32("clip.vision.attention.head_count", n_head)
        w.add_array("clip.vision.image_mean", [float(x) for x in mean])
        w.add_array("clip.vision.image_std", [float(x) for x in std])
        w.add_string("clip.projector_type", self.projector)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
        w.add_bool("clip.use_gelu", True)

    def matrix(self, name: str, n_out: int, n_in: int, std: float,
               qtype: QType | None = None) -> None:
        """A [n_out, n_in] weight (ne [n_in, n_out]) in qtype (default: weight_type)."""
        qtype = self.weight_type if qtype is None else qtype
        data = self.rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(std)
        if qtype == QType.F16:
            self.w.add_tensor(name, data.astype(np.float16))
        elif qtype == QType.F32:
            self.w.add_tensor(name, data)
        else:
            self.w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    def array(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0,
              dtype: type = np.float32) -> None:
        """Any other tensor (numpy order: ne reversed), f32 unless dtype says."""
        data = mean + std * self.rng.standard_normal(shape, dtype=np.float32)
        self.w.add_tensor(name, data.astype(dtype))

    def norm(self, prefix: str, n: int) -> None:
        self.array(f"{prefix}.weight", (n,), 0.05, 1.0)
        self.array(f"{prefix}.bias", (n,), 0.02)

    def linear(self, prefix: str, n_out: int, n_in: int, std: float | None = None) -> None:
        self.matrix(f"{prefix}.weight", n_out, n_in, std if std else n_in ** -0.5)
        self.array(f"{prefix}.bias", (n_out,), 0.02)

    def siglip_tower(self, *, n_embd: int, n_ff: int, n_layer: int, patch: int,
                     image_size: int) -> None:
        """A SigLIP tower's tensors (Gemma 3's and Idefics3's): patch and position embeddings,
        the layers, the closing norm."""
        self.array("v.patch_embd.bias", (n_embd,), 0.02)
        self.array("v.patch_embd.weight", (n_embd, 3, patch, patch), (3 * patch * patch) ** -0.5)
        self.array("v.position_embd.weight", ((image_size // patch) ** 2, n_embd), 0.1)
        for il in range(n_layer):
            blk = f"v.blk.{il}"
            self.norm(f"{blk}.ln1", n_embd)
            self.norm(f"{blk}.ln2", n_embd)
            self.linear(f"{blk}.ffn_up", n_ff, n_embd)
            self.linear(f"{blk}.ffn_down", n_embd, n_ff)
            for proj in ("attn_k", "attn_out", "attn_q", "attn_v"):
                self.linear(f"{blk}.{proj}", n_embd, n_embd)
        self.norm("v.post_ln", n_embd)

    def close(self) -> None:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def write_siglip_mmproj(path: str | Path, *, n_layer: int = 27, n_embd: int = 1152,
                        n_head: int = 16, n_ff: int = 4304, patch: int = 14,
                        image_size: int = 448, n_embd_text: int = 2560,
                        weight_type: QType = QType.F16, seed: int = 0) -> Path:
    """A Gemma 3 SigLIP mmproj (`gemma3`: pooled 4 x 4, soft-emb RMSNorm, input projection)."""
    path = Path(path)
    c = _Writer(path, "gemma3", seed, weight_type)
    c.vision(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head, image_size=image_size,
             patch=patch, n_embd_text=n_embd_text, mean=IMAGE_MEAN_SIGLIP,
             std=IMAGE_STD_SIGLIP, eps=1e-6)
    # the projection stored [n_embd, n_embd_text] (ne [n_embd_text, n_embd]), f16 as converted
    c.matrix("mm.input_projection.weight", n_embd, n_embd_text, n_embd ** -0.5,
             QType.F16 if weight_type == QType.F16 else weight_type)
    c.array("mm.soft_emb_norm.weight", (n_embd,), 0.05, 1.0)  # Gemma's (1 + w), folded
    c.siglip_tower(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, patch=patch,
                   image_size=image_size)
    c.close()
    return path


def write_qwen3vl_mmproj(path: str | Path, *, n_layer: int = 24, n_embd: int = 1024,
                         n_head: int = 16, n_ff: int = 4096, patch: int = 16, merge: int = 2,
                         n_pos: int = 2304, deepstack: Sequence[int] = (5, 11, 17),
                         n_embd_text: int = 2048, weight_type: QType = QType.F16,
                         seed: int = 0) -> Path:
    """A Qwen3-VL mmproj (`qwen3vl_merger`: merger `mm.0` / `mm.2`, deepstack mergers)."""
    path = Path(path)
    side = round(n_pos ** 0.5)
    c = _Writer(path, "qwen3vl_merger", seed, weight_type)
    c.vision(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head,
             image_size=side * patch, patch=patch, n_embd_text=n_embd_text,
             mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), eps=1e-6)
    c.w.add_uint32("clip.vision.spatial_merge_size", merge)
    c.w.add_array("clip.vision.is_deepstack_layers", [il in deepstack for il in range(n_layer)])
    wide = n_embd * merge * merge
    for il in range(n_layer):
        blk = f"v.blk.{il}"
        c.linear(f"{blk}.attn_out", n_embd, n_embd)
        c.linear(f"{blk}.attn_qkv", 3 * n_embd, n_embd)
        c.linear(f"{blk}.ffn_up", n_ff, n_embd)
        c.linear(f"{blk}.ffn_down", n_embd, n_ff)
        c.norm(f"{blk}.ln1", n_embd)
        c.norm(f"{blk}.ln2", n_embd)
    for il in deepstack:
        c.linear(f"v.deepstack.{il}.fc1", wide, wide)
        c.linear(f"v.deepstack.{il}.fc2", n_embd_text, wide)
        c.norm(f"v.deepstack.{il}.norm", wide)
    c.linear("mm.0", wide, wide)
    c.linear("mm.2", n_embd_text, wide)
    c.norm("v.post_ln", n_embd)
    c.array("v.patch_embd.bias", (n_embd,), 0.02)
    kstd = (2 * 3 * patch * patch) ** -0.5
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        c.array(name, (n_embd, 3, patch, patch), kstd, dtype=np.float16)
    c.array("v.position_embd.weight", (side * side, n_embd), 0.1)  # ggml_interpolate: f32
    c.close()
    return path


def write_idefics3_mmproj(path: str | Path, *, n_layer: int = 12, n_embd: int = 768,
                          n_head: int = 12, n_ff: int = 3072, patch: int = 16,
                          image_size: int = 512, scale: int = 4, longest_edge: int = 2048,
                          n_embd_text: int = 960, weight_type: QType = QType.F16,
                          seed: int = 0) -> Path:
    """An Idefics3 mmproj (`idefics3`: the SigLIP tower per tile, pixel-shuffled by `scale`
    and projected by `mm.model.fc`, no bias)."""
    path = Path(path)
    c = _Writer(path, "idefics3", seed, weight_type)
    c.vision(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head, image_size=image_size,
             patch=patch, n_embd_text=n_embd_text, mean=IMAGE_MEAN_SIGLIP,
             std=IMAGE_STD_SIGLIP, eps=1e-6)
    c.w.add_uint32("clip.vision.projector.scale_factor", scale)
    c.w.add_uint32("clip.vision.preproc_image_size", longest_edge)
    wide = n_embd * scale * scale
    c.matrix("mm.model.fc.weight", n_embd_text, wide, wide ** -0.5)
    c.siglip_tower(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, patch=patch,
                   image_size=image_size)
    c.close()
    return path


def idefics3_vocab(vocab_size: int | None = None) -> TinyVocab:
    """The synthetic byte-level vocabulary with Idefics3's markers (user-defined) and a
    `\n\n` token (a merge of two `\n`: mtmd looks its piece up), padded to vocab_size."""
    v = build_tiny_vocab(extra_tokens=IDEFICS3_TOKENS)
    nl = "\u010a"  # "\n" in the byte-level alphabet
    tokens, types = [*v.tokens, nl + nl], [*v.token_types, 1]
    if vocab_size is not None:
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        types += [5] * (vocab_size - len(types))
    return TinyVocab(tokens, types, [*v.merges, f"{nl} {nl}"])


def write_text_like_smolvlm_500m(path: str | Path, *, weight_type: QType = QType.Q8_0,
                                 seed: int = 0) -> Path:
    """SmolVLM-500M's text model with random weights: llama, 32 layers, 960 wide, 15 / 5 heads
    of 64, ff 2560, vocabulary 49,280, tied embeddings (~0.4 GB in Q8_0)."""
    return write_tiny_model(
        path, arch="llama", n_layer=32, n_embd=960, n_head=15, n_head_kv=5, n_ff=2560,
        vocab=idefics3_vocab(49280), weight_types=weight_type, tied=True, seed=seed,
        n_ctx_train=8192, rope_base=100000.0)


def write_text_for_mmproj(path: str | Path, mmproj: str | Path, *, seed: int = 0) -> Path:
    """A one-layer text GGUF whose input width is the mmproj's output width: `gemma3` for a
    gemma3 projector, `qwen3vl` (its deepstack layers counted) for qwen3vl_merger, `llama`
    with Idefics3's markers for idefics3."""
    path = Path(path)
    with GGUFFile.open(mmproj) as f:
        meta = f.metadata
        proj = str(meta.get("clip.projector_type"))
        width = int(meta["clip.vision.projection_dim"])
        n_deep = int(sum(bool(d) for d in meta.get("clip.vision.is_deepstack_layers", ())))
    head_dim = 256 if proj == "gemma3" else 128
    n_head = max(1, width // head_dim)
    if proj == "gemma3":
        return write_tiny_model(path, arch="gemma3", n_layer=1, n_embd=width, n_head=n_head,
                                n_head_kv=1, head_dim=head_dim, n_ff=256, seed=seed,
                                sliding_window=512)
    if proj == "idefics3":
        return write_tiny_model(path, arch="llama", n_layer=1, n_embd=width,
                                n_head=max(1, width // 64), n_head_kv=1, n_ff=256,
                                vocab=idefics3_vocab(), seed=seed)
    if proj != "qwen3vl_merger":
        raise ValueError(f"no text model for projector {proj!r}")
    with tempfile.TemporaryDirectory() as tmp:
        base = write_tiny_model(Path(tmp) / "qwen3.gguf", arch="qwen3", n_layer=1,
                                n_embd=width, n_head=n_head, n_head_kv=1, head_dim=head_dim,
                                n_ff=256, seed=seed)
        with GGUFFile.open(base) as f:
            keys = [k for k in f.metadata if k.startswith("qwen3.")]
            changes: dict[str, object] = {k: None for k in keys}
            changes.update({"qwen3vl." + k[len("qwen3."):]: f.metadata[k] for k in keys})
        half = head_dim // 2  # rope pairs: t / h / w sections as Qwen3-VL's [24, 20, 20]
        sections = [half * 3 // 8, half * 5 // 16, half - half * 3 // 8 - half * 5 // 16, 0]
        changes.update({"general.architecture": "qwen3vl",
                        "qwen3vl.rope.dimension_sections": np.array(sections, np.int32),
                        "qwen3vl.n_deepstack_layers": n_deep})
        return copy_gguf(base, path, metadata=changes)
