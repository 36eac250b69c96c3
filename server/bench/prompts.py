"""Synthetic prompts of a given token length for the load generator, and the tokenizer that measures
them (a model folder's tokenizer.json, kvserve's bundled model, or one token per word)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education river garden bright quiet "
    "simple large small early late young old green blue red strong open close read write walk run "
    "think build carry follow begin learn grow offer remember consider appear serve expect create"
).split()


class _HFTokenizer:
    def __init__(self, folder: Path) -> None:
        self._fast: Any
        self._auto: Any
        tokenizer_json = folder / "tokenizer.json"
        if tokenizer_json.is_file():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(tokenizer_json))
            self._auto = None
        else:
            from transformers import AutoTokenizer

            self._fast = None
            self._auto = AutoTokenizer.from_pretrained(str(folder))

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._auto.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids)
        return self._auto.decode(ids)


def load_tokenizer(spec: str | None) -> TextTokenizer | None:
    """A tokenizer from a model folder; 'auto' tries kvserve's bundled model; None or 'none' -> None."""
    if spec in (None, "", "none"):
        return None
    if spec == "auto":
        try:
            from engine import resolve_model

            return _HFTokenizer(resolve_model(None))
        except Exception as e:  # noqa: BLE001 - fall back to word counts, loudly
            logger.warning("no tokenizer (%s); approximating one token per word", e)
            return None
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"--tokenizer {spec!r} is not a folder; pass a model folder with tokenizer.json"
        )
    return _HFTokenizer(folder)


def synthetic_prompts(
    num_prompts: int, input_len: int, tokenizer: TextTokenizer | None, seed: int = 0
) -> list[str]:
    """Distinct prompts of random common words, `input_len` tokens long under `tokenizer`
    (or `input_len` words when there is none)."""
    if input_len < 1:
        raise ValueError("input length must be at least 1 token")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        words = [rng.choice(_WORDS) for _ in range(input_len * 2 if tokenizer else input_len)]
        text = " ".join(words)
        if tokenizer is not None:
            text = tokenizer.decode(tokenizer.encode(text)[:input_len])
        prompts.append(text)
    return prompts
