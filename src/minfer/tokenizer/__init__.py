"""minfer.tokenizer: BPE from GGUF metadata, streaming detokenization, chat templates.

Public API (see docs/interfaces.md):
- `Tokenizer.from_gguf(f)` / `load_tokenizer(f)`: `.encode`, `.decode`, `.token_bytes`, …
- `IncrementalDecoder(tokenizer)`: `.push(id) -> str`, `.flush() -> str`.
- `ChatTemplate.from_gguf(f, tokenizer)`: `.render(messages, add_generation_prompt=…, tools=…)`.
"""

from minfer.tokenizer.chat import CHATML, ChatTemplate
from minfer.tokenizer.stream import IncrementalDecoder
from minfer.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["CHATML", "ChatTemplate", "IncrementalDecoder", "Tokenizer", "load_tokenizer"]
