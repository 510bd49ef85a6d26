"""`minfer convert HF_DIR OUT.gguf`: a Hugging Face safetensors checkpoint to GGUF, as
llama.cpp's convert_hf_to_gguf.py writes it (Qwen2, Qwen3, Llama/Mistral, SmolLM3, Phi-3,
Gemma 3, Qwen2-MoE, Qwen3-MoE, Mixtral, BERT)."""

from __future__ import annotations

import argparse

from minfer.cli.info_cmd import human_bytes
from minfer.convert import OUTTYPES, convert_hf


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF")
    p.add_argument("model_dir", help="directory with config.json, *.safetensors and a tokenizer")
    p.add_argument("output", help="the .gguf to write (must not exist)")
    p.add_argument("--outtype", choices=tuple(OUTTYPES), default="f16",
                   help="type of the 2-D weights (default f16; norms and biases stay f32)")
    p.add_argument("--tokenizer-pre", metavar="NAME",
                   help="llama.cpp pre-tokenizer name when the BPE split regex is not recognised")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = convert_hf(args.model_dir, args.output, outtype=args.outtype,
                     tokenizer_pre=args.tokenizer_pre, progress=not args.quiet)
    print(f"{out}  {human_bytes(out.stat().st_size)}")
    return 0
