"""Remake tests/fixtures/wordpiece_llamacpp.json: llama.cpp's WordPiece ids for texts in many
scripts, on the `ggml-vocab-bert-bge` vocabulary of the llama-cpp-python 0.3.36 sdist.

    python scripts/make_wordpiece_fixture.py VOCAB.gguf   # run with a python that has llama_cpp
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEXTS = ["Hello, World!", "naïve café résumé", "Ελληνικά και русский текст",
         "中文分词测试，日本語のテキスト、한국어", "emoji 🦙🔥👍 test",
         "tab\tnew\nline  double  space", "x=1+2*3/4; y = [a, b]; print(f'{x}')",
         "don't won't it's", "ＦＵＬＬＷＩＤＴＨ ｃｈａｒｓ", "İstanbul ǅemal ß straße",
         "under_score-dash.dot@at#hash$dollar%", "\u200bzero\u200dwidth\u00adsoft",
         "numbers 3.14159 1,000,000 2nd 21st",
         "supercalifragilisticexpialidocious antidisestablishmentarianism", "مرحبا بالعالم",
         "ñandú pingüino", "a", "", "   ", "🤖"]


def main() -> None:
    from llama_cpp import Llama

    m = Llama(sys.argv[1], vocab_only=True, verbose=False)
    out = {"source": "llama-cpp-python 0.3.36, ggml-vocab-bert-bge.gguf, "
                     "tokenize(text, add_bos=True, special=False)",
           "cases": [{"text": t, "ids": m.tokenize(t.encode(), add_bos=True, special=False)}
                     for t in TEXTS]}
    path = Path(__file__).parent.parent / "tests" / "fixtures" / "wordpiece_llamacpp.json"
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
