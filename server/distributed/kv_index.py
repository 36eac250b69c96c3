"""What each replica's KV cache holds, as its published KV events say (pure Python, no Ray, no ZMQ):
the external block hashes stored and not yet removed, per replica, and the longest run of a
request's leading block hashes a replica holds. Events arrive already decoded from the vLLM wire
arrays (engine.core.kv_events' layout); only the main attention group counts. And the routing
policy over it: the replica holding most leading blocks, else power-of-two choices. A LoRA
adapter's blocks hash under its content (`lora:<sha256>`, in their extra keys); the router learns
which content each replica serves under an adapter's name from the names its events carry."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine import cache_namespace, external_block_hashes


@dataclass(frozen=True)
class ReplicaEvents:
    """Where a replica publishes (as it registered in the replica directory)."""

    replica: Hashable
    endpoint: str
    replay_endpoint: str | None
    block_size: int
    hash_seed: str
    topic: str = ""


R = TypeVar("R")

MAIN_KINDS = (None, "full_attention")  # a hybrid model's sliding groups do not make a prefix hit
LORA_PREFIX = "lora:"  # engine.executor.lora_adapters: an adapter's namespace is its content hash


def _lora_namespace(event: list[Any]) -> str | None:
    """The LoRA namespace in a BlockStored event's extra keys (None: a base-model block)."""
    extra = _field(event, 8)
    if not isinstance(extra, list) or not extra or not isinstance(extra[0], list | tuple):
        return None
    first = extra[0][0] if extra[0] else None
    return first if isinstance(first, str) and first.startswith(LORA_PREFIX) else None


class KVIndex:
    """Replica -> held block hashes; thread-safe (a feed thread writes, the router reads)."""

    def __init__(self) -> None:
        self._held: dict[Hashable, set[int]] = {}
        self._side_groups: dict[Hashable, set[int]] = {}  # group_idx of sliding-window groups
        self._adapters: dict[Hashable, dict[str, str]] = {}  # adapter name -> its LoRA namespace
        self._lock = threading.Lock()

    def apply(self, replica: Hashable, events: Iterable[list[Any]]) -> None:
        """Apply one batch's decoded events (each a list: tag first, then vLLM's fields)."""
        with self._lock:
            held = self._held.setdefault(replica, set())
            side = self._side_groups.setdefault(replica, set())
            adapters = self._adapters.setdefault(replica, {})
            for event in events:
                tag = event[0]
                if tag == "AllBlocksCleared":
                    held.clear()
                elif tag == "BlockStored":
                    name, namespace = _field(event, 7), _lora_namespace(event)
                    if isinstance(name, str) and namespace is not None:
                        adapters[name] = namespace  # a reloaded adapter: its newest content
                    if _field(event, 10) in MAIN_KINDS:
                        held.update(event[1])
                    elif _field(event, 9) is not None:
                        side.add(_field(event, 9))
                elif tag == "BlockRemoved" and _field(event, 3) not in side:
                    held.difference_update(event[1])

    def clear(self, replica: Hashable) -> None:
        """Forget what a replica held (its stream broke past replay: state unknown)."""
        with self._lock:
            self._held[replica] = set()

    def forget(self, replica: Hashable) -> None:
        with self._lock:
            self._held.pop(replica, None)
            self._side_groups.pop(replica, None)
            self._adapters.pop(replica, None)

    def adapter_namespace(self, replica: Hashable, model: str) -> str | None:
        """The LoRA namespace a replica's events showed for adapter `model` (its name, or
        "<base>:<name>"); None when they showed none (the base model, or no block stored yet)."""
        with self._lock:
            adapters = self._adapters.get(replica, {})
            found = adapters.get(model)
            if found is None and ":" in model:
                found = adapters.get(model.rpartition(":")[2])
            return found

    def match(self, replica: Hashable, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the replica holds."""
        with self._lock:
            held = self._held.get(replica)
            if not held:
                return 0
            matched = 0
            for h in hashes:
                if h not in held:
                    break
                matched += 1
            return matched

    def num_blocks(self, replica: Hashable) -> int:
        with self._lock:
            return len(self._held.get(replica, ()))


def route(
    candidates: list[R],
    key: Callable[[R], Hashable],
    loads: dict[Hashable, int],
    matches: dict[Hashable, int],
    total: int,
    imbalance_threshold: int,
    min_match_ratio: float,
) -> list[list[R]]:
    """The replica matching most leading blocks (of `total`) first, then the rest by load; or, when
    no replica matches enough or the best is too busy, two random replicas, less loaded first.
    `key(replica)` names a replica in `loads` and `matches`."""
    least = min(loads[key(r)] for r in candidates)
    if total:
        best = max(candidates, key=lambda r: (matches.get(key(r), 0), -loads[key(r)]))
        matched = matches.get(key(best), 0)
        balanced = loads[key(best)] - least <= imbalance_threshold
        if matched and matched >= min_match_ratio * total and balanced:
            others = sorted((r for r in candidates if r is not best), key=lambda r: loads[key(r)])
            return [[best], others] if others else [[best]]
    pair = random.sample(candidates, k=min(2, len(candidates)))
    return [sorted(pair, key=lambda r: loads[key(r)])]


def kv_matches(
    index: KVIndex,
    sources: dict[Hashable, ReplicaEvents],
    replicas: Sequence[Hashable],
    tokens: list[int],
    cache_salt: str | None = None,
    model: str | None = None,
) -> tuple[dict[Hashable, int], int]:
    """Per replica with known events, the leading blocks of `tokens` it holds; and the number of
    full blocks (0 when no replica's events are known). A request's blocks hash as the engine
    hashes them: a salt in the first block's extra keys, so it matches only blocks of its own salt;
    for an adapter `model`, the adapter's LoRA namespace in every block's (as that replica's
    events showed it, else as another's). Until some replica has stored blocks of an adapter, its
    requests hash as the base model's (the router cannot tell an adapter's name from the base's)."""
    loras = {r: index.adapter_namespace(r, model) for r in replicas} if model else {}
    anywhere = next((lora for lora in loras.values() if lora is not None), None)
    hashes: dict[tuple[int, str, str | None], list[int]] = {}
    matches: dict[Hashable, int] = {}
    total = 0
    for replica in replicas:
        source = sources.get(replica)
        if source is None:
            continue
        namespace = cache_namespace(loras.get(replica) or anywhere, cache_salt)
        scheme = (source.block_size, source.hash_seed, namespace)
        if scheme not in hashes:
            hashes[scheme] = external_block_hashes(
                tokens, source.block_size, namespace, source.hash_seed
            )
        total = max(total, len(hashes[scheme]))
        matches[replica] = index.match(replica, hashes[scheme])
    return matches, total


def _field(event: list[Any], index: int) -> Any:
    return event[index] if len(event) > index else None
