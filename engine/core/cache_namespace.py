"""Prefix-cache namespaces (no torch): what roots a request's block chain apart in the prefix trie, the
KV tiers and the KV events' hashes. A LoRA adapter's content (`lora:<sha256>`) and a cache salt
(vLLM's `cache_salt` request field) combine into one namespace string, which splits back into its
two parts for the events (the salt is hashed into a chain's first block only, as vLLM does)."""

from __future__ import annotations

import hashlib

from engine.core.errors import InvalidRequestError

SALT_PREFIX = "salt:"
_SALT_SEPARATOR = "|" + SALT_PREFIX  # a LoRA namespace is `lora:` + hex: it never holds this


def check_cache_salt(cache_salt: object) -> None:
    """A cache salt is a non-empty string (vLLM refuses an empty one)."""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")


def cache_namespace(lora_namespace: str | None, cache_salt: str | None) -> str | None:
    """The namespace of a request on `lora_namespace` (None: the base model) with `cache_salt`
    (None: unsalted)."""
    if cache_salt is None:
        return lora_namespace
    if lora_namespace is None:
        return SALT_PREFIX + cache_salt
    return lora_namespace + _SALT_SEPARATOR + cache_salt


def split_namespace(namespace: str | None) -> tuple[str | None, str | None]:
    """(the LoRA part, the cache salt) of a namespace built by cache_namespace."""
    if namespace is None:
        return None, None
    if namespace.startswith(SALT_PREFIX):
        return None, namespace[len(SALT_PREFIX) :]
    lora, sep, salt = namespace.partition(_SALT_SEPARATOR)
    return lora, (salt if sep else None)


def stored_namespace(namespace: str | None) -> str | None:
    """The namespace as a disk file records it: a cache salt is kept only as its SHA-256, so the
    files never hold a tenant's salt (equal salts still give equal names)."""
    lora, salt = split_namespace(namespace)
    if salt is None:
        return namespace
    digest = hashlib.sha256(salt.encode()).hexdigest()
    return cache_namespace(lora, "sha256:" + digest)
