"""Which replica has seen which prompt prefix: chained hashes of fixed-size character blocks of
the routing text, an LRU set per replica, and the longest-prefix match. Pure Python, no Ray."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

BLOCK_CHARS = 64
MAX_BLOCKS_PER_REPLICA = 200_000


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _body_string(body: bytes, key: str) -> str | None:
    data = _json_object(body)
    value = data.get(key) if data is not None else None
    return value if isinstance(value, str) and value else None


def routing_salt(body: bytes) -> str | None:
    """The request's `cache_salt` (vLLM's field; None when absent or not one the replica takes)."""
    return _body_string(body, "cache_salt")


def routing_model(body: bytes) -> str | None:
    """The request's `model` (a LoRA adapter's blocks hash apart; None when absent)."""
    return _body_string(body, "model")


def routing_text(path: str, body: bytes) -> str:
    """The prompt text of an OpenAI request body in a prefix-stable form: a later turn of a chat
    extends the text of its earlier turns. Empty when the body carries no prompt."""
    data = _json_object(body)
    if data is None:
        return ""
    parts: list[str] = []
    for key in ("instructions", "system"):  # Responses / Messages style system text
        _append_content(parts, data.get(key))
    for key in ("messages", "input"):
        value = data.get(key)
        if isinstance(value, list):
            for message in value:
                if isinstance(message, dict):
                    parts.append(f"\x1e{message.get('role', '')}\x1f")
                    _append_content(parts, message.get("content"))
                else:
                    _append_content(parts, message)
        else:
            _append_content(parts, value)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch routes by its first prompt
    _append_content(parts, prompt)
    return "".join(parts)


def _append_content(parts: list[str], content: Any) -> None:
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for item in content:
            if isinstance(item, dict):
                _append_content(parts, item.get("text"))
            elif isinstance(item, (str, int)):
                parts.append(f"{item} " if isinstance(item, int) else item)


def block_hashes(
    text: str, block_chars: int = BLOCK_CHARS, cache_salt: str | None = None
) -> list[bytes]:
    """One hash per whole block; each hash covers all text before it, so equal hashes mean
    equal prefixes. A cache salt roots the chain apart, as the engine's prefix cache does: salted
    text matches only text routed with the same salt."""
    hashes: list[bytes] = []
    previous = b""
    if cache_salt is not None:
        previous = hashlib.blake2b(b"salt:" + cache_salt.encode(), digest_size=16).digest()
    for start in range(0, len(text) - block_chars + 1, block_chars):
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per replica, the most recently routed block hashes (bounded, least recently used dropped)."""

    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA) -> None:
        self.max_blocks = max_blocks_per_replica
        self._blocks: dict[Hashable, OrderedDict[bytes, None]] = {}

    def match(self, replica: Hashable, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` this replica has seen."""
        seen = self._blocks.get(replica)
        if not seen:
            return 0
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        return matched

    def insert(self, replica: Hashable, hashes: list[bytes]) -> None:
        seen = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas that are gone (their caches died with them)."""
        keep = set(replicas)
        for replica in [r for r in self._blocks if r not in keep]:
            del self._blocks[replica]
