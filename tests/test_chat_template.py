"""Chat templates on synthetic models: HF conventions, sandboxing, errors by line."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from minfer.errors import TemplateError
from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import CHATML, ChatTemplate, Tokenizer
from minfer.tools.synth import write_tiny_model

from .test_tokenizer import fake_gguf

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(fake_gguf())


def template(source: str, tok: Tokenizer) -> ChatTemplate:
    return ChatTemplate.from_gguf(fake_gguf(**{"tokenizer.chat_template": source}), tok)


def test_synthetic_model_template(tiny_qwen2: Path) -> None:
    f = GGUFFile.open(tiny_qwen2)
    tok = Tokenizer.from_gguf(f)
    ct = ChatTemplate.from_gguf(f, tok)
    text = ct.render(MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not ct.is_default
    ids = tok.encode_prompt(text)
    assert ids[0] == tok.token_id("<|im_start|>")
    assert ids.count(tok.token_id("<|im_end|>")) == 2


def test_missing_template_is_chatml(tmp_path: Path, tok: Tokenizer) -> None:
    path = write_tiny_model(tmp_path / "none.gguf", chat_template="")
    ct = ChatTemplate.from_gguf(GGUFFile.open(path), tok)
    assert ct.is_default and ct.source == CHATML
    assert ct.render(MESSAGES, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


@pytest.mark.parametrize("value", [
    {"b": 1, "a": ["é", "😀", "<tag>&"], "n": None, "f": 1.5, "t": True},
    ["x", 2, {"nested": {"k": "v"}}],
    "plain </script> 'quoted'",
])
def test_tojson_matches_transformers(tok: Tokenizer, value: object) -> None:
    ct = template("{{ v | tojson }}|{{ v | tojson(indent=2) }}|"
                  "{{ v | tojson(separators=(',', ':'), sort_keys=true) }}", tok)
    assert ct.render([], v=value) == "|".join([
        json.dumps(value, ensure_ascii=False),
        json.dumps(value, ensure_ascii=False, indent=2),
        json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)])


def test_hf_variables(tok: Tokenizer) -> None:
    source = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}|"
              "{{ tools | length }}|{{ custom }}|{{ documents is none }}|"
              "{{ unk_token is defined }}")
    ct = template(source, tok)
    out = ct.render([], tools=[{"name": "f"}], custom="x", add_generation_prompt=False)
    assert out == "<|endoftext|>|<|im_end|>||False|1|x|True|False"  # no pad id: undefined
    assert template("{{ tools is none }}", tok).render([]) == "True"
    f = fake_gguf(**{"tokenizer.ggml.padding_token_id": tok.token_id("<|endoftext|>"),
                     "tokenizer.chat_template": "{{ pad_token }}"})
    assert ChatTemplate.from_gguf(f, Tokenizer.from_gguf(f)).render([]) == "<|endoftext|>"


def test_trim_and_lstrip_blocks(tok: Tokenizer) -> None:
    source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n" \
             "    {% endif %}\n{% endfor %}\n"
    assert template(source, tok).render(MESSAGES) == "[Hi]\n"


def test_loop_controls_and_generation_block(tok: Tokenizer) -> None:
    source = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
              "{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}")
    assert template(source, tok).render([*MESSAGES, {"role": "user", "content": "no"}]) == "Hi"


def test_strftime_now(tok: Tokenizer) -> None:
    out = template("{{ strftime_now('%Y-%m-%d') }}", tok).render([])
    assert out in {datetime.now().strftime("%Y-%m-%d"), datetime.now().strftime("%Y-%m-%d")}


def test_raise_exception_is_template_error(tok: Tokenizer) -> None:
    ct = template("{% if messages[0].role != 'user' %}\n"
                  "{{ raise_exception('first message must be user') }}{% endif %}", tok)
    with pytest.raises(TemplateError, match=r"line 2.*first message must be user"):
        ct.render(MESSAGES)


def test_runtime_error_names_line(tok: Tokenizer) -> None:
    ct = template("ok\n{{ messages[5].content }}\n", tok)
    with pytest.raises(TemplateError, match="line 2"):
        ct.render(MESSAGES)


def test_sandbox_refuses_mutation(tok: Tokenizer) -> None:
    ct = template("{{ messages.append(1) }}", tok)
    with pytest.raises(TemplateError, match="unsafe"):
        ct.render(MESSAGES)
    ct = template("{{ ''.__class__.__mro__ }}", tok)
    with pytest.raises(TemplateError, match="unsafe"):
        ct.render([])


def test_syntax_error_refuses_load_naming_line(tok: Tokenizer) -> None:
    bad = "{% for m in messages %}\n{{ m.content }}\n{% if %}\n{% endfor %}"
    with pytest.raises(TemplateError, match=re.escape("line 3")):
        template(bad, tok)
    with pytest.raises(TemplateError, match="line 1"):
        template("{% frobnicate %}", tok)
