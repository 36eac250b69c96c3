"""Chat template, EOS ids and per-token bytes of the engine's tokenizer wrapper."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.text.tokenizer import Tokenizer, _generation_config_eos

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


def tokenizer_copy(smollm2_dir: Path, dst: Path, with_template: bool = True) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if with_template and (smollm2_dir / "chat_template.jinja").is_file():
        shutil.copy(smollm2_dir / "chat_template.jinja", dst / "chat_template.jinja")
    return dst


def test_chat_template_renders_smollm2_format_ending_with_assistant_prompt(tokenizer: Tokenizer):
    ids = tokenizer.apply_chat_template(MESSAGES)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids[0] == tokenizer.hf.convert_tokens_to_ids("<|im_start|>")  # a special token, not text
    without_prompt = tokenizer.decode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False), False
    )
    assert without_prompt.endswith("<|im_end|>\n")


def test_eos_ids_include_generation_config(smollm2_dir: Path, tmp_path: Path):
    folder = tokenizer_copy(smollm2_dir, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    tok = Tokenizer.from_pretrained(folder)
    assert tok.hf.eos_token_id == 2
    assert tok.eos_token_ids == {0, 2, 5}  # generation config's ids and the tokenizer's own
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert _generation_config_eos(folder) == [7]


def test_smollm2_eos_is_im_end(tokenizer: Tokenizer):
    assert tokenizer.eos_token_ids == {tokenizer.hf.convert_tokens_to_ids("<|im_end|>")}


def test_missing_chat_template_raises_value_error_and_override_works(
    smollm2_dir: Path, tmp_path: Path
):
    folder = tokenizer_copy(smollm2_dir, tmp_path, with_template=False)
    inline = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    overridden = Tokenizer.from_pretrained(folder, chat_template=inline)
    ids = overridden.apply_chat_template(MESSAGES)
    assert overridden.decode(ids) == "[user]What is 2+2?[assistant]"

    plain = Tokenizer(overridden.hf, overridden.eos_token_ids)
    with pytest.raises(ValueError, match="chat template"):
        plain.apply_chat_template(MESSAGES)
    template_file = tmp_path / "template.jinja"
    template_file.write_text(inline)
    from_file = Tokenizer(plain.hf, plain.eos_token_ids, chat_template=str(template_file))
    assert from_file.apply_chat_template(MESSAGES) == ids
    with pytest.raises(ValueError, match="neither"):
        Tokenizer(plain.hf, plain.eos_token_ids, chat_template=str(tmp_path / "missing.jinja"))


def test_template_errors_become_value_errors(tokenizer: Tokenizer):
    raising = "{{ raise_exception('roles must alternate') }}"
    strict = Tokenizer(tokenizer.hf, tokenizer.eos_token_ids, chat_template=raising)
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template(MESSAGES)


def test_minilm_has_no_chat_template(minilm_dir: Path):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(minilm_dir).apply_chat_template(MESSAGES)


def test_missing_tokenizer_files_raise_value_error(tmp_path: Path):
    with pytest.raises(ValueError, match="tokenizer"):
        Tokenizer.from_pretrained(tmp_path)


def test_token_bytes_rebuild_utf8_and_strings_mark_partial_characters(tokenizer: Tokenizer):
    text = " café 😀 你好"
    ids = tokenizer.encode(text)
    token_bytes = tokenizer.token_bytes(ids)
    assert b"".join(bytes(b) for b in token_bytes).decode("utf-8") == text
    strings = tokenizer.token_strings(ids)
    assert " café" in strings
    partial = [s for s in strings if s.startswith("bytes:")]
    assert partial and all(s.startswith("bytes:\\x") for s in partial)
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.token_strings([im_end]) == ["<|im_end|>"]
    assert tokenizer.token_bytes([im_end]) == [list(b"<|im_end|>")]


def test_vocab_size_counts_added_tokens(tokenizer: Tokenizer):
    assert tokenizer.vocab_size == len(tokenizer.hf) == 49152
    assert tokenizer.encode("Hello there") == tokenizer.hf.encode("Hello there")
