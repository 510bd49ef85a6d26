"""`minfer embed`: embeddings (or rerank scores) of texts, one JSON line each.

    minfer embed MODEL TEXT [TEXT ...] [--pooling P] [--embd-normalize N] [--truncate]
    minfer embed MODEL --file FILE             one text per line ('-' reads stdin)
    minfer embed MODEL --rerank QUERY TEXT...  relevance of each TEXT (a document) to QUERY

Each input prints `{"index": i, "embedding": [...], "n_tokens": n}` in input order (with
`--rerank`: `{"index": i, "relevance_score": s}`). An encoder pools as its file says; a
generative model pools its last token unless `--pooling` says otherwise. Vectors are unit
length unless `--embd-normalize` picks another norm (llama.cpp's: -1 none, 0 max-abs to int16,
1 taxicab, 2 euclidean, p > 2 the p-norm).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from minfer.errors import MinferError
from minfer.gguf.hparams import POOLING_TYPES


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "embed", help="embed texts (or rerank documents) with an embedding model",
        description="Print each text's embedding as one JSON line, in order.")
    p.add_argument("model", help="model path or name")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed")
    p.add_argument("--file", metavar="FILE", help="read one text per line ('-' = stdin)")
    p.add_argument("--pooling", choices=POOLING_TYPES,
                   help="pooling (default: the model file's; last token for a generative one)")
    p.add_argument("--embd-normalize", type=int, default=2, metavar="N",
                   help="-1 none, 0 max-abs (int16), 1 taxicab, 2 euclidean (default), "
                        "p > 2 p-norm")
    p.add_argument("--truncate", action="store_true",
                   help="cut inputs longer than the model reads instead of refusing them")
    p.add_argument("--rerank", metavar="QUERY",
                   help="score each TEXT as a document for QUERY (a reranker model)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.set_defaults(func=run)


def _texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts)
    if args.file is not None:
        try:
            raw = sys.stdin.read() if args.file == "-" else \
                Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MinferError(f"cannot read {args.file}: {exc}") from None
        texts += [line for line in raw.splitlines() if line.strip()]
    if not texts:
        raise MinferError("nothing to embed: give TEXT arguments or --file")
    return texts


def run(args: argparse.Namespace) -> int:
    from minfer.api import load
    from minfer.engine.warmup import announce_cold_start, engine_marker, mark_warm

    texts = _texts(args)
    model = load(args.model, threads=args.threads)
    out = sys.stdout
    pooling = args.pooling if args.rerank is None else (  # as model.rerank picks it
        "rank" if model.hparams.n_cls_out else None)
    embedder = model.embedder(pooling)
    marker = engine_marker(embedder.engine)
    cold = announce_cold_start(marker)  # an encoder compiles as it first runs
    if args.rerank is not None:
        scores = model.rerank(args.rerank, texts, truncate=args.truncate)
        for i, score in enumerate(scores):
            out.write(json.dumps({"index": i, "relevance_score": score}) + "\n")
        if cold:
            mark_warm(marker)
        return 0
    encoded = embedder.check([embedder.encode_text(t) for t in texts], truncate=args.truncate)
    vectors = embedder.run(encoded, norm=args.embd_normalize)
    for i, (enc, vec) in enumerate(zip(encoded, vectors, strict=True)):
        line: dict[str, Any] = {"index": i, "embedding": vec.tolist(), "n_tokens": len(enc.ids)}
        out.write(json.dumps(line) + "\n")
    if cold:
        mark_warm(marker)
    return 0
