"""Cost of collision-safe prefix-cache keys: admitting many 1-4k-token prompts at 0% and 100% hit rate
with exact `(parent node, tokens)` keys (what KVCacheManager uses), keyed blake2b / sha256 chains, and
the old unkeyed 64-bit tuple-hash chain, plus the whole KVCacheManager admission path. No model, no torch.

    python -m benchmarks.prefix_key_bench --num-prompts 200 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestGroup, Sequence
from engine.core.sampling_params import SamplingParams

Blocks = list[tuple[int, ...]]
_KEY = os.urandom(32)  # per-process secret, as a keyed scheme would have


def _split(tokens: list[int], block_size: int) -> Blocks:
    return [
        tuple(tokens[i : i + block_size])
        for i in range(0, len(tokens) // block_size * block_size, block_size)
    ]


# Each scheme admits one prompt: compute its block keys in chain order, look them up until the first
# miss, then register the missing blocks. `cache` maps a key to a fake block id.


def admit_unkeyed_hash(blocks: Blocks, cache: dict) -> int:
    keys, parent = [], 0x6B7673657276
    for tokens in blocks:
        parent = hash((parent, tokens))
        keys.append(parent)
    return _lookup_then_register(keys, cache)


def admit_exact(blocks: Blocks, cache: dict) -> int:
    """Like KVCacheManager: the key holds the tokens; the parent is the matched block's node id."""
    hits, parent = 0, 0
    for i, tokens in enumerate(blocks):
        node = cache.get((parent, tokens))
        if node is None:
            for tokens in blocks[i:]:
                node = len(cache) + 1
                cache[(parent, tokens)] = node
                parent = node
            return hits
        hits += 1
        parent = node
    return hits


def _digest_chain(blocks: Blocks, digest: Callable[[bytes], bytes]) -> list[bytes]:
    keys, parent = [], b""
    for tokens in blocks:
        parent = digest(parent + array("q", tokens).tobytes())
        keys.append(parent)
    return keys


def admit_blake2b(blocks: Blocks, cache: dict) -> int:
    def digest(data: bytes) -> bytes:
        return hashlib.blake2b(data, key=_KEY, digest_size=16).digest()

    return _lookup_then_register(_digest_chain(blocks, digest), cache)


def admit_sha256(blocks: Blocks, cache: dict) -> int:
    def digest(data: bytes) -> bytes:
        return hashlib.sha256(_KEY + data).digest()

    return _lookup_then_register(_digest_chain(blocks, digest), cache)


def _lookup_then_register(keys: list, cache: dict) -> int:
    hits = 0
    for key in keys:
        if key not in cache:
            break
        hits += 1
    for key in keys[hits:]:
        cache[key] = len(cache) + 1
    return hits


SCHEMES: dict[str, Callable[[Blocks, dict], int]] = {
    "unkeyed 64-bit hash (old, unsafe)": admit_unkeyed_hash,
    "exact keys (chosen)": admit_exact,
    "keyed blake2b-128": admit_blake2b,
    "keyed sha256": admit_sha256,
}


def time_scheme(admit: Callable[[Blocks, dict], int], prompts: list[Blocks], hit: bool) -> float:
    cache: dict = {}
    if hit:
        for blocks in prompts:
            admit(blocks, cache)
    start = time.perf_counter()
    hits = sum(admit(blocks, cache) for blocks in prompts)
    elapsed = time.perf_counter() - start
    expected = sum(len(b) for b in prompts) if hit else 0
    assert hits == expected, (hits, expected)
    return elapsed


def time_manager(token_lists: list[list[int]], block_size: int, hit: bool) -> float:
    """The whole KVCacheManager admission path: find, allocate, register, free."""
    total_blocks = sum(len(t) // block_size + 1 for t in token_lists)
    kv = KVCacheManager(total_blocks + 8, block_size)

    def admit(tokens: list[int], name: str) -> int:
        group = RequestGroup(name, None, list(tokens), SamplingParams(), 16)
        seq = Sequence(f"{name}/0", group, 0, list(tokens), len(tokens))
        hit = kv.find_cached_prefix(seq)
        num_hit = hit.num_blocks if hit is not None else 0
        assert kv.allocate_slots(seq, seq.num_tokens - num_hit * block_size, hit)
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
        kv.free(seq)
        return num_hit

    if hit:
        for i, tokens in enumerate(token_lists):
            admit(tokens, f"warm{i}")
    start = time.perf_counter()
    hits = sum(admit(tokens, f"r{i}") for i, tokens in enumerate(token_lists))
    elapsed = time.perf_counter() - start
    assert (hits > 0) == hit
    return elapsed


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                    return f"{model}; " + " ".join(f for f in wanted if f in flags)
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--min-len", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--repeats", type=int, default=5, help="interleaved rounds; medians are reported"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    token_lists = [
        [rng.randrange(49152) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_prompts)
    ]
    prompts = [_split(t, args.block_size) for t in token_lists]
    num_tokens = sum(len(t) for t in token_lists)
    samples: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved: every variant sees the same machine noise
        for hit in (False, True):
            rate = "100%" if hit else "0%"
            for name, admit in SCHEMES.items():
                samples.setdefault(f"{name} @ {rate}", []).append(time_scheme(admit, prompts, hit))
            key = f"KVCacheManager admission (exact keys) @ {rate}"
            samples.setdefault(key, []).append(time_manager(token_lists, args.block_size, hit))

    print(f"CPU: {cpu_flags()}; python {sys.version.split()[0]}")
    print(f"{args.num_prompts} prompts, {num_tokens} tokens, block size {args.block_size}")
    results: dict[str, Any] = {}
    width = max(len(k) for k in samples)
    for rate in ("0%", "100%"):
        base = statistics.median(samples[f"unkeyed 64-bit hash (old, unsafe) @ {rate}"])
        for key, values in samples.items():
            if not key.endswith(f"@ {rate}"):
                continue
            median = statistics.median(values)
            per_k = median / num_tokens * 1e3 * 1e6  # microseconds per 1000 prompt tokens
            results[key] = {"median_s": median, "us_per_1k_tokens": per_k, "vs_old": median / base}
            print(f"{key:<{width}}  {per_k:8.1f} us/1k tokens  {median / base:5.2f}x old")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
