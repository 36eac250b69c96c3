"""Sliding-window KV memory on tiny random models (float32) against transformers' generate: a Mistral
(every layer slides: one group), a Qwen2 with a full and a sliding layer (two groups over one pool)
and a Gemma 3 with 5 local layers to 1 global (six one-layer groups), on prompts several windows
long, with chunked prefill, preemption and prefix-cache hits, while each sequence holds blocks for
its window, not its length, in the sliding layers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import SequenceStatus

WINDOW = 24
BLOCK = 8
BUDGET = 32  # tokens per step: long prompts are chunked
MAX_TOKENS = 12


def _save(model, out: Path, smollm2_dir: Path) -> Path:
    from transformers import GenerationConfig

    from tests.conftest import _copy_tokenizer

    torch.manual_seed(0)
    with torch.no_grad():  # larger than the default init: decisive logits, a wrong layer shows
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25 if "embed" in name else 0.12)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)
    _copy_tokenizer(smollm2_dir, out)
    return out


def _common(smollm2_dir: Path) -> dict:
    import json

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=WINDOW,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def mistral_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**_common(smollm2_dir))).eval()
    return _save(model, tmp_path_factory.mktemp("tiny_mistral"), smollm2_dir)


@pytest.fixture(scope="module")
def qwen2_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layer 0 full attention, layer 1 sliding (max_window_layers=1)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_common(smollm2_dir), use_sliding_window=True, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    return _save(model, tmp_path_factory.mktemp("tiny_qwen2"), smollm2_dir)


@pytest.fixture(scope="module")
def gemma3_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 0-4 slide, layer 5 is global (Gemma 3's 5 : 1), softcapped final logits."""
    from transformers import Gemma3TextConfig

    from tests.model.tiny_models import save_tiny_checkpoint

    common = _common(smollm2_dir)
    config = Gemma3TextConfig(
        **{k: common[k] for k in ("vocab_size", "hidden_size", "intermediate_size")},
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        sliding_window_pattern=6,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        final_logit_softcapping=12.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Gemma3ForCausalLM"],
    )
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    return save_tiny_checkpoint(
        config, tmp_path_factory.mktemp("tiny_gemma3"), smollm2_dir, embed_std=0.15
    )


def _prompts(seed: int = 3) -> list[list[int]]:
    """Prompts of 3 to 6 windows; the last two share a 90-token prefix with the first."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 40000) for _ in range(n)] for n in (100, 75, 140, 130)]
    prompts += [prompts[0][:90] + [rng.randrange(10, 40000) for _ in range(n)] for n in (9, 30)]
    return prompts


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from tests.model.tiny_models import hf_greedy, hf_reference

    return hf_greedy(hf_reference(model_dir), prompts, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate_tracking(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt, all in flight together, and the most KV blocks one sequence held
    in its sliding groups after any step."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {}
    peak = 0
    sliding = engine.kv.sliding
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        for seq in engine.scheduler.running:
            tables = engine.kv.get_block_tables(seq)
            skipped = engine.kv.num_skipped[seq.seq_id]
            peak = max(peak, max((len(tables[g]) - skipped[g] for g in sliding), default=0))
    return [tokens[f"r{i}"] for i in range(len(prompts))], peak


FAMILIES = ["mistral", "qwen2", "gemma3"]
GROUPS = {"mistral": [WINDOW], "qwen2": [None, WINDOW], "gemma3": [WINDOW] * 5 + [None]}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_with_window_release(family, request):
    model_dir = request.getfixturevalue(f"{family}_dir")
    prompts = _prompts()
    expected = _reference(model_dir, prompts)
    # Room to keep every block cached (Gemma 3's blocks are one layer each: 6 per position).
    llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="none",
        block_size=BLOCK,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        num_blocks=1024,
    )
    assert [g.window for g in llm.engine.kv_spec.groups] == GROUPS[family]
    got, peak = _generate_tracking(llm, prompts)
    assert got == expected
    # The window before a chunk, the chunk, and block rounding: never the sequence's length.
    assert 0 < peak <= -(-(WINDOW + BUDGET + BLOCK - 2) // BLOCK)
    assert peak < -(-140 // BLOCK)
    # The shared-prefix prompts hit the cache (the window's blocks were still cached).
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens > 0 for o in again)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks  # everything back after finishing


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_and_a_small_pool_keep_the_tokens(family, request):
    model_dir = request.getfixturevalue(f"{family}_dir")
    prompts = _prompts(seed=11)
    expected = _reference(model_dir, prompts)
    # Mistral: 12 blocks of 8 tokens, fewer than one 152-token sequence needs at full length (19);
    # Qwen2: its full layer's 19 blocks and the window's; Gemma 3: blocks of one layer, 19 for
    # the global layer and 5 windows. Six sequences together preempt.
    num_blocks = {"mistral": 12, "qwen2": 32, "gemma3": 64}[family]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="none",
        block_size=BLOCK,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        num_blocks=num_blocks,
    )
    got, _ = _generate_tracking(llm, prompts)
    assert got == expected
    assert llm.engine.totals.num_preemptions > 0
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_aborted_and_n_gt_1_requests_give_every_block_back(mistral_dir):
    llm = LLM(
        str(mistral_dir),
        dtype="float32",
        quantization="none",
        block_size=BLOCK,
        max_num_batched_tokens=BUDGET,
        num_blocks=128,
        enable_prefix_caching=False,
    )
    prompt = _prompts()[2]
    outs = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS))
    samples = [c.token_ids for c in outs[0].outputs]
    assert samples[0] == samples[1] == samples[2] == _reference(mistral_dir, [prompt])[0]
    engine = llm.engine
    engine.add_request("x", prompt, GREEDY)
    for _ in range(4):
        engine.step()
    (seq,) = engine.groups["x"].seqs
    assert engine.kv.num_held_blocks(seq) > 0
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.status is SequenceStatus.FINISHED_ABORTED
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
