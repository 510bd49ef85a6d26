"""Regenerate llama.cpp's mtmd reference for the vision fixtures: tests/fixtures/{vision,
idefics3}/mtmd.json and mtmd.npz (read by tests/test_vision_mtmd.py).

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_mtmd_reference.py \
        [--ref-python /tmp/refvenv/bin/python]

For each fixture (text GGUF + mmproj + image.png) the chat prompt `PROMPT` is rendered by
minfer (the image part as mtmd's `<__media__>` marker) and handed with the image to llama.cpp
(llama-cpp-python's `mtmd_cpp` bindings, run in the reference interpreter by
tests/mtmd_ref.py): mtmd_tokenize's chunks (text tokens; image chunks' token counts),
the image chunks' embeddings (mtmd_encode_chunk, the encoder's attention without flash
attention), the logits after the prompt (mtmd_helper_eval_chunks) and after each of 6 greedy
tokens, the greedy tokens and the top-1 minus top-2 margin before each.

mtmd.json: {"prompt", "chunks", "n_tokens", "n_pos", "greedy", "margins"}; mtmd.npz: `embd`
([image rows, n_embd] f32, the image chunks in prompt order), `logits` ([7, n_vocab] f32).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import mtmd_ref  # noqa: E402

FIXTURES = ("vision", "idefics3")
QUESTION = "What is in the image?"


def messages(image: Path) -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "image", "path": str(image)},
                                         {"type": "text", "text": QUESTION}]}]


def prompt_text(model: Path, image: Path) -> str:
    """The chat prompt as minfer renders it, the image part as the media marker."""
    from minfer.api import Model
    from minfer.engine.vision.prompt import split_images

    return Model(model, n_ctx=256).render_chat(split_images(messages(image))[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref-python", default="/tmp/refvenv/bin/python",
                    help="an interpreter with llama-cpp-python (its mtmd_cpp bindings)")
    args = ap.parse_args()
    for name in FIXTURES:
        d = ROOT / "tests" / "fixtures" / name
        text = prompt_text(d / "model.gguf", d / "image.png")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ref.npz"
            ref = mtmd_ref.run(args.ref_python, d / "model.gguf", d / "mmproj.gguf",
                               d / "image.png", text, out)
            arrays = dict(np.load(out))
        np.savez_compressed(d / "mtmd.npz", embd=arrays["embd"].astype(np.float32),
                            logits=arrays["logits"].astype(np.float32))
        (d / "mtmd.json").write_text(json.dumps({"prompt": text, **ref}, indent=1) + "\n")
        print(name, "chunks", [c["type"][0] + str(c.get("n_tokens", len(c.get("tokens", []))))
                               for c in ref["chunks"]], "greedy", ref["greedy"],
              f"min margin {min(ref['margins']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
