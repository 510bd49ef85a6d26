"""A tokenizer's special tokens, add-BOS/EOS/SEP flags, merges, chat template and normalizer
flags, read from `tokenizer.json` / `tokenizer_config.json` / `config.json` exactly as the
`SpecialVocab` of llama.cpp 0.3.36's own gguf-py reads them.

The `gguf` release on the package index lags the gguf-py llama.cpp's converter ships: it
ignores a `ByteLevel` post-processor (which says "add neither BOS nor EOS", so llama.cpp's files
carry `tokenizer.ggml.add_bos_token = false` and `add_eos_token = false`), lets
`tokenizer_config.json` override the post-processor's flags, and reads no normalizer. This is
that reader, written once here, so what `minfer convert` writes does not depend on which
`gguf` is installed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf

log = logging.getLogger(__name__)

SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_TEMPLATE_KEY = "tokenizer.chat_template"


class SpecialVocab:
    """What `add_to_gguf` writes after the token list (llama.cpp's key order)."""

    def __init__(self, path: Path, *, load_merges: bool = False, n_vocab: int | None = None):
        self.n_vocab = n_vocab
        self.load_merges = load_merges
        self.merges: list[str] = []
        self.special_token_ids: dict[str, int] = {}
        self.add_special_token: dict[str, bool] = {}
        self.chat_template: str | Sequence[Mapping[str, str]] | None = None
        self.normalizer_lowercase: bool | None = None
        self.normalizer_strip_accents: bool | None = None
        self.special_token_types: tuple[str, ...] = SPECIAL_TYPES
        self._from_tokenizer_json(path)
        self._from_config_json(path)
        if load_merges and not self.merges:
            self._from_merges_txt(path)

    def add_to_gguf(self, w: gguf.GGUFWriter) -> None:
        if self.merges:
            w.add_token_merges(self.merges)
        elif self.load_merges:
            log.warning("merges requested but none found: the vocabulary may not work")
        for typ, tid in self.special_token_ids.items():
            if (add_id := getattr(w, f"add_{typ}_token_id", None)) is not None:
                add_id(tid)
        for typ, value in self.add_special_token.items():
            if (add_flag := getattr(w, f"add_add_{typ}_token", None)) is not None:
                add_flag(value)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)
        if self.normalizer_lowercase is not None:
            w.add_bool("tokenizer.ggml.normalizer.lowercase", self.normalizer_lowercase)
        if self.normalizer_strip_accents is not None:
            w.add_bool("tokenizer.ggml.normalizer.strip_accents", self.normalizer_strip_accents)

    def _set_special_token(self, typ: str, tid: Any) -> None:
        if not isinstance(tid, int):
            return
        if tid < 0:
            raise ValueError(f"invalid value for special token type {typ}: {tid}")
        if self.n_vocab is None or tid < self.n_vocab:
            self.special_token_ids.setdefault(typ, tid)

    def _from_merges_txt(self, path: Path) -> None:
        merges_file = path / "merges.txt"
        if not merges_file.is_file():
            return
        lines = merges_file.read_text(encoding="utf-8").splitlines()
        if lines and lines[0].strip().startswith("#"):
            lines = lines[1:]
        for line in lines:
            parts = line.strip().split(None, 3)
            if len(parts) == 2:
                self.merges.append(f"{parts[0]} {parts[1]}")

    def _parse_normalizer(self, normalizer: dict[str, Any]) -> None:
        kind = normalizer.get("type")
        if kind == "Lowercase":
            self.normalizer_lowercase = True
        elif kind == "StripAccents":
            self.normalizer_strip_accents = True
        elif kind == "BertNormalizer":
            if "lowercase" in normalizer:
                self.normalizer_lowercase = normalizer["lowercase"]
            if "strip_accents" in normalizer:
                self.normalizer_strip_accents = normalizer["strip_accents"]
        elif kind == "Sequence":
            for step in normalizer.get("normalizers", []):
                self._parse_normalizer(step)

    def _read_merges(self, tokenizer: dict[str, Any]) -> None:
        merges = tokenizer.get("model", {}).get("merges")
        if not isinstance(merges, list) or not merges:
            return
        if isinstance(merges[0], str):
            self.merges = merges
        elif isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
            # transformers >= 4.45 writes pairs; a space inside a part becomes U+0120
            self.merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part)
                                    for part in pair) for pair in merges]
        else:
            raise ValueError("unknown tokenizer merges format")

    def _from_tokenizer_json(self, path: Path) -> None:
        tokenizer: dict[str, Any] | None = None
        added_tokens: list[dict[str, Any]] = []
        if (path / "tokenizer.json").is_file():
            tokenizer = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
            if self.load_merges:
                self._read_merges(tokenizer)
            if normalizer := tokenizer.get("normalizer"):
                self._parse_normalizer(normalizer)
            added_tokens = tokenizer.get("added_tokens", [])
        config: dict[str, Any] | None = None
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        if tokenizer and (post := tokenizer.get("post_processor")):
            self._read_post_processor(post, config)
        if not config:
            return
        self._read_chat_template(path, config)
        for typ in self.special_token_types:
            add_entry = config.get(f"add_{typ}_token")
            if isinstance(add_entry, bool):
                self.add_special_token.setdefault(typ, add_entry)  # the post-processor wins
            entry = config.get(f"{typ}_token")
            content = entry.get("content") if isinstance(entry, dict) else entry
            if not isinstance(content, str):
                continue
            self._set_special_token(typ, next(
                (a.get("id") for a in added_tokens if a.get("content") == content), None))

    def _read_chat_template(self, path: Path, config: dict[str, Any]) -> None:
        alt: str | list[dict[str, str]] | None = None
        if (path / "chat_template.jinja").is_file():
            alt = (path / "chat_template.jinja").read_text(encoding="utf-8")
            if extra := list((path / "additional_chat_templates").glob("*.jinja")):
                alt = [{"name": "default", "template": alt}]
                alt += [{"name": p.stem, "template": p.read_text(encoding="utf-8")}
                        for p in extra]
        elif (path / "chat_template.json").is_file():
            alt = json.loads((path / "chat_template.json").read_text(encoding="utf-8")
                             ).get("chat_template")
        template = config.get("chat_template", alt)
        if template is None or isinstance(template, (str, list)):
            self.chat_template = template
        else:
            log.warning("tokenizer_config.json: a chat_template of type %s is ignored",
                        type(template).__name__)

    def _read_post_processor(self, post: dict[str, Any], config: dict[str, Any] | None) -> None:
        """The add-BOS/EOS/SEP flags a post-processor implies (llama.cpp's crude parse of
        simple templates), filling missing specials of `config` in place as it does."""
        cfg = config or {}
        bos, cls = cfg.get("bos_token"), cfg.get("cls_token")
        eos, sep = cfg.get("eos_token"), cfg.get("sep_token")
        if not bos and cls and config:
            config["bos_token"] = bos = cls
        if not eos and sep and config:
            config["eos_token"] = eos = sep
        for proc in post.get("processors", [post]):
            kind = proc.get("type")
            if kind == "ByteLevel":
                self.add_special_token.setdefault("bos", False)
                self.add_special_token.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                self.add_special_token.update(bos=True, eos=True, sep=True)
                if not cls and config:
                    config["cls_token"] = cls = proc.get("cls", [bos])[0]
                if not sep and config:
                    config["sep_token"] = sep = proc.get("sep", [eos])[0]
            elif kind == "TemplateProcessing":
                bos, cls, eos = self._read_template(proc, config, bos, cls, eos, sep)

    def _read_template(self, proc: dict[str, Any], config: dict[str, Any] | None, bos: Any,
                       cls: Any, eos: Any, sep: Any) -> tuple[Any, Any, Any]:
        single, pair = proc.get("single", []), proc.get("pair", [])
        first = last = None
        if len(single) > 1:
            if first := single[0].get("SpecialToken", {}).get("id"):
                if not config:
                    bos = first
                elif first not in (bos, cls):
                    if not bos:
                        config["bos_token"] = bos = first
                    if not cls:
                        config["cls_token"] = cls = first
                self.add_special_token["bos"] = first in (bos, cls)
            if last := single[-1].get("SpecialToken", {}).get("id"):
                if not config:
                    eos = last
                elif last != eos:
                    if "eot" not in self.special_token_types:
                        self.special_token_types += ("eot",)
                        config["eot_token"] = eos
                    elif "eom" not in self.special_token_types:
                        self.special_token_types += ("eom",)
                        config["eom_token"] = eos
                    config["eos_token"] = eos = last
                self.add_special_token["eos"] = last == eos
        if not pair:
            return bos, cls, eos
        start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
        stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
        pair = pair[slice(start, stop)]
        if not pair:
            return bos, cls, eos
        seq_a = pair[0].get("Sequence", {}).get("id")
        seq_b = pair[-1].get("Sequence", {}).get("id")
        if seq_a == "A" and seq_b == "B" and (middle := pair[1:-1]):  # A [sep] [eos] B
            add_sep = False
            entry = middle[0].get("SpecialToken", {}).get("id")
            if entry and entry in (sep, eos) and not last:
                add_sep = True
            if len(middle) == 2:
                entry = middle[1].get("SpecialToken", {}).get("id")
                if entry and entry in (sep, eos):
                    add_sep = True
            self.add_special_token["sep"] = add_sep
            if add_sep and not sep and config:
                config["sep_token"] = eos
        return bos, cls, eos

    def _from_config_json(self, path: Path) -> None:
        if not (path / "config.json").is_file():
            return
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        for typ in self.special_token_types:
            tid = config.get(f"{typ}_token_id")
            if tid is None and "text_config" in config:
                tid = config["text_config"].get(f"{typ}_token_id")
            self._set_special_token(typ, tid)
