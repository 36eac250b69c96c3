"""Our Llama (SmolLM2, float32, CPU) against transformers: logits of whole prompts, chunked prefill
plus decodes through a paged cache with scattered blocks, mixed batches, and greedy generation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.kernels.attention import AttentionMetadata, allocate_kv_cache
from engine.models.loader import load_model

TOLERANCE = 1e-3  # max |log_softmax difference|
BLOCK_SIZE = 8
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within decades, print shops spread across Europe and"
)


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path):
    return load_model(smollm2_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)(TEXT)["input_ids"]


@pytest.fixture(scope="module")
def prompt_ref(reference, prompt_ids) -> torch.Tensor:
    return reference_logprobs(reference, prompt_ids)


def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def max_diff(logits: torch.Tensor, ref_logprobs: torch.Tensor) -> float:
    return (logits.float().log_softmax(-1) - ref_logprobs).abs().max().item()


class PagedCache:
    """A minimal stand-in for the engine: a KV pool and per-sequence block tables drawn at random."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0):
        self.model = model
        self.kv = allocate_kv_cache(
            model.num_layers,
            num_blocks,
            BLOCK_SIZE,
            model.num_kv_heads,
            model.head_dim,
            torch.float32,
            "cpu",
        )
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)  # scattered, non-monotonic block tables
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, work: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over [(seq, new tokens)], decodes first; returns each seq's logits."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for seq, tokens in work:
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            self.lengths[seq] = end
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            ids += tokens
            positions += range(start, end)
        meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, BLOCK_SIZE)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv, meta)
        logits = self.model.compute_logits(hidden)  # [num_tokens, vocab]
        return list(logits.split(query_lens))


def test_full_prompt_prefill_matches_transformers(ours, prompt_ref, prompt_ids):
    cache = PagedCache(ours.model)
    (logits,) = cache.step([("a", prompt_ids)])
    assert logits.shape == (len(prompt_ids), ours.model.vocab_size)
    assert max_diff(logits, prompt_ref) < TOLERANCE


def test_chunked_prefill_then_decodes_match_transformers(ours, prompt_ref, prompt_ids):
    ref = prompt_ref
    cache = PagedCache(ours.model, seed=1)
    prefill_len = len(prompt_ids) - 4
    # Chunks that start and end mid-block, then one token at a time.
    bounds = [0, 5, 19, prefill_len]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        (logits,) = cache.step([("a", prompt_ids[lo:hi])])
        assert max_diff(logits, ref[lo:hi]) < TOLERANCE, (lo, hi)
    for pos in range(prefill_len, len(prompt_ids)):
        (logits,) = cache.step([("a", [prompt_ids[pos]])])
        assert max_diff(logits, ref[pos : pos + 1]) < TOLERANCE, pos


def test_decode_and_prefill_chunk_in_one_step(ours, reference, prompt_ids):
    other = prompt_ids[10:] + prompt_ids[:10]  # a different sequence of the same length
    ref_a = reference_logprobs(reference, prompt_ids + [other[0]])
    ref_b = reference_logprobs(reference, other)
    cache = PagedCache(ours.model, seed=2)
    cache.step([("a", prompt_ids[:-1])])
    cache.step([("b", other[:12])])
    # One step: seq a decodes its last token while seq b prefills its next chunk.
    logits_a, logits_b = cache.step([("a", prompt_ids[-1:]), ("b", other[12:30])])
    assert max_diff(logits_a, ref_a[-2:-1]) < TOLERANCE
    assert max_diff(logits_b, ref_b[12:30]) < TOLERANCE
    # And two decodes batched together.
    logits_a, logits_b = cache.step([("a", [other[0]]), ("b", [other[30]])])
    assert max_diff(logits_a, ref_a[-1:]) < TOLERANCE
    assert max_diff(logits_b, ref_b[30:31]) < TOLERANCE


def test_greedy_generation_matches_transformers_generate(ours, reference, prompt_ids):
    num_new = 20
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            pad_token_id=ours.hf_config.eos_token_id,
        )[0, len(prompt_ids) :].tolist()
    cache = PagedCache(ours.model, seed=3)
    (logits,) = cache.step([("a", prompt_ids)])
    generated = [int(logits[-1].argmax())]
    while len(generated) < num_new:
        (logits,) = cache.step([("a", generated[-1:])])
        generated.append(int(logits[-1].argmax()))
    assert generated == expected
