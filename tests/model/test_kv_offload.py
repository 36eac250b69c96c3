"""KV offload tiers on real engines: a prefix evicted from a small pool comes back from the host-memory
tier and from the disk tier (cached tokens reported, greedy tokens identical to recomputing), a restart
with the same directory serves it from disk, damaged files are misses, a vanished directory turns the
disk tier off with one warning, and a tiny Qwen2 with a sliding layer takes tier blocks by its window."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.kv_offload import PrefixKeys
from engine.executor.kv_disk_tier import SUFFIX

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_LEN = 160  # 10 blocks; 9 of them reusable (the last token is always computed)
REUSABLE = (PROMPT_LEN - 1) // BLOCK * BLOCK
POOL = 14  # one request at a time: the next prompt evicts the last one's blocks


def _prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _llm(model_dir: Path, **options: object) -> LLM:
    options = {"quantization": "none", "block_size": BLOCK, "num_blocks": POOL, **options}
    return LLM(str(model_dir), dtype="float32", **options)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    ref = LLM(
        str(tiny_llama_dir), dtype="float32", quantization="none", enable_prefix_caching=False
    )
    return [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]


def _run_each(llm: LLM, prompts: list[list[int]]):
    return [llm.generate([p], GREEDY)[0] for p in prompts]


def _entry_path(llm: LLM, prompt: list[int], index: int) -> Path:
    store = llm.engine.kv_store
    assert store is not None and store.disk is not None
    return store.disk.root / (PrefixKeys(None, prompt, BLOCK).key(index, 0).name + SUFFIX)


def test_evicted_prefix_comes_back_from_the_host_tier(tiny_llama_dir, prompts, expected):
    llm = _llm(tiny_llama_dir, kv_offload_memory=32 << 20)
    first = _run_each(llm, prompts)  # each prompt evicts the one before it
    assert [o.outputs[0].token_ids for o in first] == expected
    assert all(o.num_cached_tokens == 0 for o in first)
    again = llm.generate([prompts[0]], GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == REUSABLE
    assert again.metrics is not None and again.metrics.num_memory_tier_tokens == REUSABLE
    stats = llm.engine.kv_store.stats
    assert stats.memory_hits == REUSABLE // BLOCK and stats.disk_hits == 0
    assert stats.saved_blocks >= 2 * REUSABLE // BLOCK
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    # Loaded blocks join the pool's prefix cache: the same prompt now hits the pool itself.
    third = llm.generate([prompts[0]], GREEDY)[0]
    assert third.num_cached_tokens == REUSABLE and third.metrics.num_memory_tier_tokens == 0


def test_evicted_prefix_comes_back_from_the_disk_tier(tiny_llama_dir, prompts, expected, tmp_path):
    llm = _llm(tiny_llama_dir, kv_offload_dir=str(tmp_path))  # no host tier
    _run_each(llm, prompts)
    llm.engine.kv_store.flush()
    again = llm.generate([prompts[0]], GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == REUSABLE
    assert again.metrics.num_disk_tier_tokens == REUSABLE
    assert llm.engine.kv_store.stats.disk_hits == REUSABLE // BLOCK


def test_a_restart_serves_known_prefixes_from_disk(tiny_llama_dir, prompts, expected, tmp_path):
    first = _llm(tiny_llama_dir, kv_offload_memory=1 << 20, kv_offload_dir=str(tmp_path))
    _run_each(first, prompts)
    first.engine.kv_store.close()  # everything queued is on disk
    restarted = _llm(tiny_llama_dir, kv_offload_memory=1 << 20, kv_offload_dir=str(tmp_path))
    out = restarted.generate([prompts[0]], GREEDY)[0]  # wholly evicted by the two after it
    assert out.outputs[0].token_ids == expected[0]
    assert out.num_cached_tokens == REUSABLE
    assert out.metrics.num_disk_tier_tokens == REUSABLE


def test_another_model_never_reads_the_files(tiny_llama_dir, prompts, tmp_path):
    first = _llm(tiny_llama_dir, kv_offload_dir=str(tmp_path))
    _run_each(first, prompts)
    first.engine.kv_store.close()
    other = _llm(tiny_llama_dir, kv_offload_dir=str(tmp_path), block_size=8, num_blocks=2 * POOL)
    assert other.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 0


def test_damaged_entries_are_misses(tiny_llama_dir, prompts, expected, tmp_path):
    first = _llm(tiny_llama_dir, kv_offload_dir=str(tmp_path))
    _run_each(first, [*prompts, *_prompts(1, seed=9)])  # the first two wholly evicted
    first.engine.kv_store.close()
    flipped = _entry_path(first, prompts[0], 5)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit of the payload
    flipped.write_bytes(bytes(data))
    cut = _entry_path(first, prompts[1], 2)
    cut.write_bytes(cut.read_bytes()[:-100])

    restarted = _llm(tiny_llama_dir, kv_offload_dir=str(tmp_path))
    outs = [restarted.generate([p], GREEDY)[0] for p in prompts[:2]]
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    assert [o.num_cached_tokens for o in outs] == [5 * BLOCK, 2 * BLOCK]  # up to the damage
    assert restarted.engine.kv_store.stats.corrupt_entries == 2


def test_a_vanished_directory_turns_the_disk_tier_off_once(
    tiny_llama_dir, prompts, expected, tmp_path, caplog
):
    root = tmp_path / "tier"
    llm = _llm(tiny_llama_dir, kv_offload_dir=str(root))
    _run_each(llm, prompts[:1])
    shutil.rmtree(root)
    with caplog.at_level(logging.WARNING, logger="engine.executor.kv_disk_tier"):
        outs = _run_each(llm, [*prompts[1:], prompts[0], *prompts])
        llm.engine.kv_store.flush()
    assert [o.outputs[0].token_ids for o in outs] == [*expected[1:], expected[0], *expected]
    warnings = [r for r in caplog.records if "disk tier off" in r.getMessage()]
    assert len(warnings) == 1
    assert not llm.engine.kv_store.stats.disk_enabled


def test_the_bundled_quantized_model_gives_the_same_tokens(smollm2_dir):
    """SmolLM2 with the default int8 blocks, host and disk tier: the recomputation's tokens."""
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(96)] for _ in range(3)]
    ref = LLM(None, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    llm = LLM(None, block_size=BLOCK, num_blocks=8, kv_offload_memory=64 << 20)
    _run_each(llm, prompts)
    again = llm.generate([prompts[0]], GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == 95 // BLOCK * BLOCK
    assert again.metrics.num_memory_tier_tokens == again.num_cached_tokens


@pytest.fixture(scope="module")
def qwen2_sliding_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layer 0 full attention, layer 1 a 24-token sliding window: two KV cache groups."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.model.test_sliding_window_kv import _common, _save

    config = Qwen2Config(**_common(smollm2_dir), use_sliding_window=True, max_window_layers=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    return _save(model, tmp_path_factory.mktemp("tiny_qwen2_tiers"), smollm2_dir)


def test_sliding_window_groups_take_tier_blocks(qwen2_sliding_dir):
    prompts = _prompts(seed=4)
    ref = LLM(
        str(qwen2_sliding_dir), dtype="float32", quantization="none", enable_prefix_caching=False
    )
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    llm = _llm(qwen2_sliding_dir, kv_offload_memory=32 << 20, num_blocks=2 * POOL)
    assert llm.engine.kv.num_groups == 2
    _run_each(llm, prompts)
    again = llm.generate([prompts[0]], GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == REUSABLE
    # The sliding group needs only its window's blocks, the full group all of them.
    stats = llm.engine.kv_store.stats
    assert REUSABLE // BLOCK < stats.memory_hits < 2 * REUSABLE // BLOCK


class _ConstantHash:
    """A blake2b stand-in whose digest never changes: every entry collides with every other."""

    def update(self, data: bytes) -> None:
        pass

    def digest(self) -> bytes:
        return b"\x00" * 16


def test_forced_digest_collisions_are_misses(
    tiny_llama_dir, prompts, expected, tmp_path, monkeypatch
):
    from engine.core import kv_offload

    monkeypatch.setattr(kv_offload, "_hasher", lambda namespace: _ConstantHash())
    llm = _llm(tiny_llama_dir, kv_offload_memory=32 << 20, kv_offload_dir=str(tmp_path))
    _run_each(llm, prompts)
    outs = _run_each(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.engine.kv_store.close()
    # One file name for every entry: the last one written wins, and reads for any other prefix miss.
    assert len(list(llm.engine.kv_store.disk.root.iterdir())) == 1
    restarted = _llm(tiny_llama_dir, kv_offload_dir=str(tmp_path))
    outs = _run_each(restarted, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens <= BLOCK for o in outs)


def test_preempted_requests_report_tier_tokens_within_their_cached_tokens(
    tiny_llama_dir, prompts, expected
):
    llm = _llm(tiny_llama_dir, num_blocks=24, kv_offload_memory=32 << 20)
    _run_each(llm, prompts)  # the tiers now hold every prompt's prefix
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    outs = llm.generate(prompts, long)  # 3 x 18 blocks in a 24-block pool: preemptions
    assert any(o.metrics.num_preemptions for o in outs)
    for o in outs:
        tier = o.metrics.num_memory_tier_tokens + o.metrics.num_disk_tier_tokens
        assert tier <= o.num_cached_tokens <= REUSABLE, (o.metrics, o.num_cached_tokens)
        assert o.outputs[0].token_ids[:8] == expected[prompts.index(o.prompt_token_ids)]
