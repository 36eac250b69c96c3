"""The model's tokenizer: encode/decode, chat template, EOS ids and per-token bytes for logprobs."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback pieces
_SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's word-boundary marker


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character map used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_level_decoder()


class Tokenizer:
    """Wraps a fast Hugging Face tokenizer with the few operations the engine and server need."""

    def __init__(
        self,
        hf: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf
        self.vocab_size = len(hf)
        self.eos_token_ids = eos_token_ids
        # chat_template: a file path or inline Jinja overriding the tokenizer's own template
        self.chat_template = _load_chat_template(chat_template) or getattr(
            hf, "chat_template", None
        )
        self._added_ids = set(hf.added_tokens_decoder)
        # Added tokens by text (Qwen3's <think>, <tool_call>): grammars name these by id.
        self.added_tokens = {t.content: i for i, t in hf.added_tokens_decoder.items()}
        self._decoder_kind = _decoder_kind(hf)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_pretrained(cls, model_dir: Path, chat_template: str | None = None) -> Tokenizer:
        """Load from a local model folder; `chat_template` is a file path or inline Jinja."""
        model_dir = Path(model_dir)
        try:
            hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"could not load a tokenizer from {model_dir}: {exc}. The folder needs "
                "tokenizer.json (or the tokenizer files its tokenizer_config.json names)."
            ) from exc
        eos = set(_generation_config_eos(model_dir))
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        if not eos:
            logger.warning("no EOS token found for %s; generation stops only on length", model_dir)
        return cls(hf, frozenset(eos), chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of tokenization spaces: the text must equal the concatenated stream deltas.
        text = self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

    def decode_stream(
        self, context_ids: list[int], skip_special_tokens: bool
    ) -> Callable[[int], str | None] | None:
        """A step function over `tokenizers`' DecodeStream (one Rust call per token: the new text,
        or None while a character is incomplete), for byte-level tokenizers, where its text equals
        decode()'s; None where that agreement is not established (the caller decodes windows)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or self._decoder_kind != "byte_level":
            return None
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):  # tokenizers < 0.22 has no DecodeStream(ids=...)
            return None
        return lambda token_id: stream.step(backend, token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render messages (role + content, tool calls) and `tools` with the chat template and
        tokenize the result."""
        text = self.render_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        # The rendered text already holds any BOS the template wants, like transformers does.
        return self.encode(text, add_special_tokens=False)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's text for `messages` and `tools` (tokenize it with
        add_special_tokens=False); `template_kwargs` are extra template variables (such as
        `enable_thinking`)."""
        if not self.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; pass one with --chat-template "
                "(a file path or inline Jinja), or use the completions API"
            )
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tools=tools,  # type: ignore[arg-type]
                tokenize=False,
                **(template_kwargs or {}),
            )
        except TemplateError as exc:
            raise InvalidRequestError(
                f"the chat template rejected these messages: {exc}", "messages"
            ) from exc
        assert isinstance(text, str)
        return text

    def token_bytes(self, ids: list[int]) -> list[list[int]]:
        """Raw UTF-8 bytes of each token on its own (OpenAI's `bytes` logprob field)."""
        return [list(self._bytes_of(i)) for i in ids]

    def token_strings(self, ids: list[int]) -> list[str]:
        """Display string per token: its text, or "bytes:\\xNN..." when not valid UTF-8 alone."""
        strings = []
        for token_id in ids:
            raw = self._bytes_of(token_id)
            try:
                strings.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                strings.append("bytes:" + "".join(f"\\x{b:02x}" for b in raw))
        return strings

    def _bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._compute_bytes(token_id)
            self._bytes_cache[token_id] = cached
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if token_id in self._added_ids:  # added tokens are stored as plain text
            return piece.encode("utf-8")
        if self._decoder_kind == "byte_level" and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if self._decoder_kind == "sentencepiece":
            match = _BYTE_FALLBACK.match(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _decoder_kind(hf: PreTrainedTokenizerBase) -> str:
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return "other"
    state = decoder.__getstate__()
    state = state.decode() if isinstance(state, bytes) else str(state)
    if '"ByteLevel"' in state:
        return "byte_level"
    if "ByteFallback" in state or "Metaspace" in state or _SPIECE_SPACE in state:
        return "sentencepiece"
    return "other"


def _generation_config_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(e) for e in eos]


def _load_chat_template(chat_template: str | None) -> str | None:
    """A template given as a file path is read; anything containing Jinja markup is inline."""
    if chat_template is None:
        return None
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise ValueError(
            f"chat template {chat_template!r} is neither a readable file nor inline Jinja"
        )
    return path.read_text()
