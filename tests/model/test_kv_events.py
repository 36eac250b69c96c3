"""KV events of a real engine run (a tiny random Llama) read by a pyzmq + msgpack subscriber: every
batch decodes, sequence numbers are gapless from 0, replay after a gap returns the missed batches,
every block hash recomputes from token ids, and evictions publish removals."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.kv_event_subscriber import CacheView, Subscriber, decode, low64, prompt_digests

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture
def llm(tiny_llama_dir):
    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv@test@tiny",
    }
    llm = LLM(str(tiny_llama_dir), block_size=BLOCK, num_blocks=40, kv_events_config=config)
    yield llm
    llm.engine.close()


def prompts(llm: LLM, n: int, shared: str, words: int = 30) -> list[list[int]]:
    return [
        llm.tokenizer.encode(shared + " ".join(f"w{i}x{j}" for j in range(words))) for i in range(n)
    ]


def test_a_subscriber_sees_every_event_of_a_run(llm) -> None:
    publisher = llm.engine.kv_events.publisher
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv@")
    try:
        sub.poll(0.3)  # connected (the slow joiner's first batches come from replay below)
        shared = "The shared system prompt of every request in this test. " * 3
        first = prompts(llm, 2, shared)
        llm.generate(first, GREEDY)
        llm.generate(prompts(llm, 12, "Other text, evicting the first prompts. "), GREEDY)
        llm.engine.kv_events.flush()
        # Everything published reaches the subscriber; replay fills what the slow joiner missed.
        total = _wait_for(sub, publisher)
        missed = sub.replay(0)
        assert set(missed) == set(range(total)), "replay returns every buffered batch"
        for seq, payload in sub.received.items():
            assert missed[seq] == payload, "replay re-sends the published bytes"
        assert sub.topics == {b"kv@test@tiny"}

        view = CacheView()
        kinds = []
        for seq in range(total):  # gapless, decoded in order
            ts, events, rank = decode(missed[seq])
            assert ts > 0 and rank == 0 and events
            view.apply(events)  # asserts every hash recomputes from its parent and tokens
            kinds += [e.kind for e in events]
        assert kinds[0] == "AllBlocksCleared", "batch 0 says the engine starts empty"
        assert "BlockStored" in kinds and "BlockRemoved" in kinds, "the small pool evicted"
        # The view a router rebuilt is the pool's cache, and a prompt's blocks recompute from its
        # token ids alone (as a router hashes an incoming request).
        assert len(view.held) == len(llm.engine.kv.pool.cached)
        stored = set(view.digests)
        for tokens in first:
            hashes = [low64(d) for d in prompt_digests(tokens, BLOCK)]
            assert hashes and set(hashes) <= stored
        assert publisher.state().num_batches == total
        assert llm.engine.snapshot.kv_events is not None
    finally:
        sub.close()


def test_replay_after_a_gap_returns_the_missed_batches(llm) -> None:
    publisher = llm.engine.kv_events.publisher
    llm.generate(prompts(llm, 3, "A prompt before anyone listens. "), GREEDY)
    llm.engine.kv_events.flush()
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        sub.poll(0.3)
        llm.generate(prompts(llm, 2, "Now someone listens. "), GREEDY)
        llm.engine.kv_events.flush()
        total = _wait_for(sub, publisher)
        first_live = min(sub.received)
        assert first_live > 0, "the batches before the subscriber joined were not delivered live"
        missed = sub.replay(0)
        assert sorted(missed) == list(range(total))
        assert {s: missed[s] for s in sub.received} == sub.received
        later = sub.replay(first_live)
        assert sorted(later) == list(range(first_live, total))
        assert sub.replay(total) == {}, "nothing after the last batch: just the end marker"
        # A cache reset (nothing running) publishes AllBlocksCleared, and the pool starts over.
        assert llm.engine.reset_prefix_cache()
        # The publisher's thread sends it: wait until it has, then ask for it again.
        assert _wait_for(sub, publisher) == total + 1
        (cleared,) = sub.replay(total).values()
        assert [e.kind for e in decode(cleared)[1]] == ["AllBlocksCleared"]
        assert not llm.engine.kv.pool.cached
    finally:
        sub.close()


def _wait_for(sub: Subscriber, publisher) -> int:
    """The number of batches published, once the publisher's queue is empty."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sub.poll(0.1)
        if (
            publisher._queue.empty()
            and publisher.num_batches
            and max(sub.received, default=-1) == publisher.num_batches - 1
        ):
            return publisher.num_batches
    raise AssertionError("the publisher did not drain")


def test_tier_blocks_publish_their_medium(tiny_llama_dir, tmp_path) -> None:
    """Blocks saved to the host and disk tiers are BlockStored with medium "CPU" / "STORAGE"
    (vLLM's offloading connector's names) under the hashes the pool's events gave them; a block a
    tier drops is BlockRemoved with its medium."""
    import random

    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", quantization="none", block_size=BLOCK,
        num_blocks=14, kv_offload_memory=1 << 20, kv_offload_dir=str(tmp_path),
        kv_events_config=config,
    )  # fmt: skip
    try:
        rng = random.Random(1)
        runs = [[rng.randrange(100, 30000) for _ in range(80)] for _ in range(6)]
        for tokens in runs:  # each prompt evicts the one before it into the tiers
            llm.generate([tokens], GREEDY)
        llm.engine.kv_store.flush()  # the disk writes are done
        llm.engine.kv_events.flush()
        publisher = llm.engine.kv_events.publisher
        sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
        try:
            history = sub.replay(0)
        finally:
            sub.close()
        digests = {low64(d) for tokens in runs for d in prompt_digests(tokens, BLOCK)}
        stored: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        for seq in sorted(history):
            for e in decode(history[seq])[1]:
                if e.kind == "BlockStored":
                    stored[e.fields[6]].update(e.block_hashes)
                    assert len(e.fields[3]) == BLOCK * len(e.block_hashes)
                elif e.kind == "BlockRemoved" and e.fields[2] != "GPU":
                    assert set(e.block_hashes) <= stored[e.fields[2]], "removes what it stored"
        stats = llm.engine.kv_store.stats
        assert stored["CPU"] and stored["STORAGE"], stored
        assert stored["CPU"] <= digests and stored["STORAGE"] <= digests
        assert stored["CPU"] <= stored["GPU"], "a tier block keeps the hash the pool gave it"
        assert len(stored["STORAGE"]) == stats.disk_entries
    finally:
        llm.engine.close()
