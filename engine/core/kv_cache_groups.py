"""KV cache groups (no torch): a model's layers grouped by attention window, and the window arithmetic
that says which blocks a sliding group still needs.

Layout (the hybrid design of vLLM's KV cache manager): every group has the same number of layers,
`group_size`, and the cache is `group_size` per-layer tensors [2, num_blocks, block_size, kv_heads, d]
shared by all groups: layer j of a group lives in tensor j. A block id belongs to one group at a time
(the one whose table holds it), so one pool of block ids serves every group and memory stays fungible:
a block a sliding layer gave back can hold a full-attention layer's tokens next. A model with one kind
of layer has one group of all its layers: exactly the plain one-table-per-sequence cache. Separate
pools per window would need their sizes guessed up front from the workload (how long sequences are
against the window) and strand memory in whichever pool is not the bottleneck; the shared pool needs no
such guess. With mixed kinds, group_size is the smallest kind's layer count, and a kind whose count it
does not divide gets one shorter last group (its blocks leave the unused tensors' slots empty).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    # The layers' sliding window (transformers' semantics); None = full attention.
    window: int | None
    layers: tuple[int, ...]  # model layer indices, in order: layer layers[j] uses cache tensor j


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    groups: tuple[KVCacheGroup, ...]
    group_size: int  # layers per group = per-layer cache tensors allocated

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def layer_slots(self) -> list[tuple[int, int]]:
        """Per model layer: (its group, its cache tensor)."""
        slots: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                slots[layer] = (g, j)
        return [slots[i] for i in range(len(slots))]


def kv_cache_spec(layer_windows: list[int | None], max_model_len: int | None = None) -> KVCacheSpec:
    """Group layers by window. A window that covers the whole model length is full attention (it
    never releases anything, so it joins the full group)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {i} has sliding window {window}; it must be at least 1")
        if window is not None and max_model_len is not None and window >= max_model_len:
            window = None
        kinds.setdefault(window, []).append(i)
    size = min(len(layers) for layers in kinds.values())
    groups = []
    for window, layers in kinds.items():  # first-layer order: the full group first for Llama-likes
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroup(window, tuple(layers[start : start + size])))
    return KVCacheSpec(tuple(groups), size)


def first_needed_block(window: int | None, position: int, block_size: int) -> int:
    """The first block a query at `position` (or any later one) can attend to: a query at p sees
    keys at positions > p - window; every block before this one is out of every such window."""
    if window is None:
        return 0
    return max(0, (position - window + 1) // block_size)
