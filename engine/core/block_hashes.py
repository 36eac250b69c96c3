"""External block hashes (no torch): the stable, recomputable names KV events give cached blocks,
vLLM's `sha256_cbor` prefix-caching scheme, so a router can derive them from token ids alone.

A full block's digest is `sha256(canonical CBOR of [parent digest, token ids, extra keys]))`, chained
from `NONE_HASH = sha256(canonical CBOR of the seed string)` for a chain's first block; the seed is
the PYTHONHASHSEED value, as in vLLM (kvserve uses "0" when it is unset, where vLLM picks a random
one). Events carry the digest's low 64 bits as an unsigned int (vLLM's default
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`). Extra keys are None for the plain model and
the LoRA namespace on every block of an adapter's chain, as vLLM puts the adapter's name in its extra
keys, and a cache salt after it on a chain's first block only, as vLLM does (the chain carries it on).
The pool's own trie keys stay exact: these hashes only name blocks outside the engine."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import cbor2

from engine.core.cache_namespace import split_namespace

DEFAULT_SEED = "0"

ExtraKeys = tuple[str, ...] | None


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `value` (tuples encode as CBOR arrays)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """The parent digest of every chain's first block."""
    return sha256_cbor(seed)


def extra_keys(namespace: str | None, first: bool = False) -> ExtraKeys:
    """The extra keys hashed into a block of a chain in `namespace` (`first`: the chain's first
    block, which alone carries a cache salt)."""
    lora, salt = split_namespace(namespace)
    keys = tuple(k for k in (lora, salt if first else None) if k is not None)
    return keys or None


def block_digest(parent: bytes, token_ids: Sequence[int], extra: ExtraKeys = None) -> bytes:
    """The digest of one full block after a block (or NONE_HASH) whose digest is `parent`."""
    return sha256_cbor((parent, tuple(token_ids), extra))


def external_hash(digest: bytes) -> int:
    """The digest as events carry it: its low 64 bits, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def external_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str | None = None,
    seed: str = DEFAULT_SEED,
) -> list[int]:
    """The external hashes of the full blocks of `token_ids` (a router's view of a prompt)."""
    parent = none_hash(seed)
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = extra_keys(namespace, first=start == 0)
        parent = block_digest(parent, token_ids[start : start + block_size], extra)
        hashes.append(external_hash(parent))
    return hashes
