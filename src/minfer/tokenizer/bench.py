"""Tokenizer speed check: `python -m minfer.tokenizer.bench [MODEL] [--mb N]`.

Prints the load time of the tokenizer (metadata → ready to encode) and the encode / decode
throughput on English prose (Python's own help texts, `pydoc_data.topics`, repeated up to N MB).
Informational only: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import time
from pydoc_data.topics import topics


def english_prose(n_bytes: int) -> str:
    """About `n_bytes` of English prose (UTF-8), cut at a line boundary."""
    base = "\n\n".join(topics[k] for k in sorted(topics))
    text = base * (n_bytes // len(base.encode()) + 1)
    cut = text.encode()[:n_bytes].decode(errors="ignore")
    return cut[: cut.rfind("\n") + 1] or cut


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minfer.tokenizer.bench")
    parser.add_argument("model", nargs="?", default=None, help="GGUF path or model name")
    parser.add_argument("--mb", type=float, default=1.0, help="prose size in MB (default 1)")
    args = parser.parse_args(argv)

    from minfer.gguf.reader import GGUFFile
    from minfer.store import resolve_model
    from minfer.tokenizer import Tokenizer

    f = GGUFFile.open(resolve_model(args.model))
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(f)
    load_s = time.perf_counter() - t0
    print(f"load      {load_s * 1e3:8.1f} ms  ({tok.n_vocab} tokens, {tok.kind})")

    text = english_prose(int(args.mb * 1e6))
    n_bytes = len(text.encode())
    t0 = time.perf_counter()
    ids = tok.encode(text)
    enc_s = time.perf_counter() - t0
    print(f"encode    {n_bytes / enc_s / 1e6:8.2f} MB/s  ({n_bytes} bytes → {len(ids)} tokens, "
          f"{enc_s:.3f} s)")
    t0 = time.perf_counter()
    back = tok.decode(ids)
    dec_s = time.perf_counter() - t0
    verdict = "ok" if back == text else "DIFFERS"
    print(f"decode    {n_bytes / dec_s / 1e6:8.2f} MB/s  (round trip {verdict})")


if __name__ == "__main__":
    main()
