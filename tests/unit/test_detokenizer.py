"""Streaming text never splits a UTF-8 character; stop strings match across tokens and are held back."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer

MULTILINGUAL = "Hello 😀👍🏽 你好，世界！ café 🇯🇵 done"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


def stream(
    tokenizer: Tokenizer,
    text_or_ids: str | list[int],
    stop: list[str] | None = None,
    include_stop: bool = False,
    prompt: str = "Say something:",
    skip_special_tokens: bool = True,
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed tokens one at a time like the engine does; return the deltas and the matched stop."""
    ids = tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    detok = IncrementalDetokenizer(
        tokenizer, tokenizer.encode(prompt), skip_special_tokens, stop or [], include_stop
    )
    deltas = []
    matched = None
    for token_id in ids:
        matched = detok.add_tokens([token_id])
        deltas.append(detok.take_delta(finished=matched is not None))
        if matched is not None:
            break
    else:
        deltas.append(detok.take_delta(finished=True))
    return deltas, matched, detok


def test_emoji_and_cjk_stream_equals_full_decode_without_replacement_chars(tokenizer: Tokenizer):
    ids = tokenizer.encode(MULTILINGUAL)
    deltas, matched, detok = stream(tokenizer, ids)
    assert matched is None
    assert "".join(deltas) == tokenizer.decode(ids) == MULTILINGUAL
    assert detok.text == MULTILINGUAL
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas[:-1]  # some tokens carried only part of a character and were held


def test_empty_prompt_and_special_tokens(tokenizer: Tokenizer):
    ids = tokenizer.encode("Hi there") + [tokenizer.hf.convert_tokens_to_ids("<|im_end|>")]
    skipped, _, _ = stream(tokenizer, ids, prompt="")
    kept, _, _ = stream(tokenizer, ids, prompt="", skip_special_tokens=False)
    assert "".join(skipped) == "Hi there"
    assert "".join(kept) == "Hi there<|im_end|>"


def test_unterminated_utf8_is_released_at_finish(tokenizer: Tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # drop the token completing the emoji
    deltas, _, detok = stream(tokenizer, ids)
    assert "".join(deltas[:-1]) == "ok"
    assert deltas[-1].endswith("\ufffd")  # the finish releases what is held, as decode() does
    assert detok.text == tokenizer.decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tokenizer: Tokenizer, include: bool):
    text = "The answer is forty two. Then more"
    assert " forty" in tokenizer.token_strings(tokenizer.encode(text))  # the stop spans 2 tokens
    deltas, matched, detok = stream(tokenizer, text, stop=["forty two"], include_stop=include)
    assert matched == "forty two"
    expected = "The answer is forty two" if include else "The answer is "
    assert detok.text == expected
    assert "".join(deltas) == expected
    assert not any("forty" in d for d in deltas[:-1])  # held back until the match was decided


def test_stop_never_completed_is_held_only_while_it_could_match(tokenizer: Tokenizer):
    ids = tokenizer.encode("The answer is forty two. Then more")
    detok = IncrementalDetokenizer(tokenizer, [], True, ["forty three"], False)
    released = ""
    for token_id in ids[:4]:  # "The answer is forty"
        assert detok.add_tokens([token_id]) is None
        released += detok.take_delta(finished=False)
    assert released == "The answer is "  # "forty" could still begin "forty three"
    assert detok.visible_text() == released and detok.text == "The answer is forty"
    detok.add_tokens([ids[4]])  # " two": no longer a possible match
    released += detok.take_delta(finished=False)
    assert released == "The answer is forty two"
    detok.add_tokens(ids[5:])
    assert detok.text == "The answer is forty two. Then more"


def test_partial_stop_at_end_is_released_at_finish(tokenizer: Tokenizer):
    deltas, matched, detok = stream(tokenizer, "Count to fort", stop=["forty"])
    assert matched is None
    assert "".join(deltas[:-1]) == "Count to "
    assert deltas[-1] == "fort"
    assert detok.text == "Count to fort"


def test_earliest_of_multiple_stop_strings_wins(tokenizer: Tokenizer):
    text = "The answer is forty two. Then more"
    _, matched, detok = stream(tokenizer, text, stop=["Then", "two", "answer is"])
    assert matched == "answer is"
    assert detok.text == "The "
    # When two stops complete on the same token, the one starting first cuts the text.
    ids = tokenizer.encode("abc xyz")
    detok = IncrementalDetokenizer(tokenizer, [], True, ["yz", "c xy"], False)
    assert detok.add_tokens(ids) == "c xy"
    assert detok.text == "ab"


def test_stop_inside_one_tokens_text_drops_the_rest(tokenizer: Tokenizer):
    assert tokenizer.token_strings(tokenizer.encode("Hello there"))[0] == "Hello"
    deltas, matched, detok = stream(tokenizer, "Hello there", stop=["ell"])
    assert matched == "ell"
    assert detok.text == "H" and "".join(deltas) == "H"
    _, _, detok = stream(tokenizer, "Hello there", stop=["ell"], include_stop=True)
    assert detok.text == "Hell"


def test_tokens_after_a_match_are_ignored(tokenizer: Tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], True, ["two"], False)
    assert detok.add_tokens(tokenizer.encode("one two three four")) == "two"
    assert detok.add_tokens(tokenizer.encode(" five")) == "two"
    assert detok.text == "one " and detok.take_delta(finished=True) == "one "


def test_stop_string_made_of_multibyte_characters(tokenizer: Tokenizer):
    deltas, matched, detok = stream(tokenizer, "你好，世界！ more", stop=["世界"])
    assert matched == "世界"
    assert detok.text == "你好，"
    assert "".join(deltas) == "你好，" and all("\ufffd" not in d for d in deltas)


# ---------------------------------------------------------------- DecodeStream agrees with windows


def _deltas(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int], skip: bool, fast: bool):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip, [], False)
    if not fast:
        detok._stream_step = None  # the window decode path, as used for other tokenizers
    deltas = []
    for token_id in ids:
        detok.add_tokens([token_id])
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, detok.text


def test_byte_level_tokenizer_uses_decode_stream(tokenizer: Tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1, 2], True, [], False)
    assert detok._stream_step is not None


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize(
    "text,prompt",
    [
        (MULTILINGUAL, "Say something:"),
        ("  leading spaces\n\ttabs and\r\nnewlines  ", ""),
        ("<|im_start|>assistant\nHi<|im_end|> after", "Q: "),
        ("ÄÖÜ ß — “quotes” …", "中文"),
    ],
)
def test_decode_stream_deltas_equal_window_decoding(tokenizer: Tokenizer, text, prompt, skip):
    """Token by token, the DecodeStream path returns exactly the old path's deltas."""
    ids, prompt_ids = tokenizer.encode(text), tokenizer.encode(prompt)
    fast, fast_text = _deltas(tokenizer, prompt_ids, ids, skip, fast=True)
    slow, slow_text = _deltas(tokenizer, prompt_ids, ids, skip, fast=False)
    assert fast == slow
    assert fast_text == slow_text == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(4))
def test_decode_stream_agrees_on_random_tokens(tokenizer: Tokenizer, seed: int):
    """Arbitrary ids (byte fragments, special tokens, broken UTF-8 at the end) decode alike."""
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    prompt_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 8))]
    for skip in (True, False):
        fast, fast_text = _deltas(tokenizer, prompt_ids, ids, skip, fast=True)
        slow, slow_text = _deltas(tokenizer, prompt_ids, ids, skip, fast=False)
        assert fast == slow
        assert fast_text == slow_text
