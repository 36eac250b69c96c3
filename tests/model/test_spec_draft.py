"""Draft-model speculation never changes the answer: a tiny random draft (few proposals accepted) and
the target as its own draft (every proposal accepted) give the greedy tokens and logprobs of plain
decoding, on int8 and int4 block weights, with chunked prefill and preemption; the layer-skip
self-draft too; the draft's tokenizer is checked at start-up; and aborts mid-verification leave the
target's and the draft's KV blocks all free."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from tests.model.tiny_models import save_tiny_checkpoint

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built"),
    pytest.mark.usefixtures("fixed_spec_cost"),  # drafts proposed whatever the machine's speed
]

PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Hello, my name is",
    "one two three four five six seven one two three four five six seven one two three",
]


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def _answers(outs):
    return [
        [(list(c.token_ids), [(t.logprob, t.top) for t in c.logprobs or []]) for c in o.outputs]
        for o in outs
    ]


def _llama(vocab_size: int, layers: int, hidden: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def target_dir(smollm2_dir, tmp_path_factory):
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    return save_tiny_checkpoint(
        _llama(vocab, 4, 128), tmp_path_factory.mktemp("spec_target"), smollm2_dir, seed=1
    )


@pytest.fixture(scope="module")
def draft_dir(smollm2_dir, tmp_path_factory):
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    return save_tiny_checkpoint(
        _llama(vocab, 2, 64), tmp_path_factory.mktemp("spec_draft"), smollm2_dir, seed=7
    )


def _drafter(llm: LLM):
    return llm.engine.scheduler.speculator.drafter


def _all_free(llm: LLM) -> bool:
    kv, draft_kv = llm.engine.kv, _drafter(llm).kv
    return kv.num_free_blocks == kv.num_blocks and draft_kv.num_free_blocks == draft_kv.num_blocks


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_random_draft_and_self_draft_identical(target_dir, draft_dir, quantization):
    kw = {"quantization": quantization, "max_num_seqs": 4}
    want = _answers(LLM(str(target_dir), **kw).generate(PROMPTS, _greedy()))
    rates = {}
    for name, draft in (("random", draft_dir), ("self", target_dir)):
        llm = LLM(
            str(target_dir),
            speculative_config={"model": str(draft), "num_speculative_tokens": 3},
            **kw,
        )
        assert _answers(llm.generate(PROMPTS, _greedy())) == want, name
        t = llm.engine.totals
        assert t.spec_num_draft_tokens > 0
        rates[name] = t.spec_num_accepted_tokens / t.spec_num_draft_tokens
        assert _all_free(llm)
    assert rates["self"] == 1.0  # the target drafting for itself: every proposal accepted
    assert rates["random"] < 0.5, rates


def test_layer_skip_self_draft_identical(target_dir):
    want = _answers(LLM(str(target_dir), max_num_seqs=4).generate(PROMPTS, _greedy()))
    llm = LLM(
        str(target_dir), max_num_seqs=4,
        speculative_config={"method": "layer_skip", "num_draft_layers": 2, "num_speculative_tokens": 3},
    )  # fmt: skip
    assert _answers(llm.generate(PROMPTS, _greedy())) == want
    drafter = _drafter(llm)
    assert drafter.model.num_layers == 2 and llm.engine.model.num_layers == 4
    assert drafter.model.layers[0] is llm.engine.model.layers[0]  # the target's weights, shared
    assert drafter.kv is llm.engine.kv  # and the target's KV of those layers: no pool of its own
    assert llm.engine.totals.spec_num_draft_tokens > 0
    assert _all_free(llm)
    # chunked prefill, a pool small enough to preempt, and prefix-cache hits
    long_prompt = " ".join(PROMPTS) * 3
    prompts = [long_prompt, *PROMPTS]
    want = _answers(LLM(str(target_dir), max_num_seqs=4).generate(prompts, _greedy(40)))
    tiny = LLM(
        str(target_dir), max_num_seqs=4, max_num_batched_tokens=32, num_blocks=20, block_size=16,
        speculative_config={"method": "layer_skip", "num_draft_layers": 3, "num_speculative_tokens": 3},
    )  # fmt: skip
    assert _answers(tiny.generate(prompts, _greedy(40))) == want
    assert _answers(tiny.generate(prompts[1:3], _greedy(40))) == want[1:3]  # prefix hits
    assert tiny.engine.totals.num_preemptions > 0 and tiny.engine.totals.spec_num_drafts > 0
    assert tiny.engine.kv.num_free_blocks == tiny.engine.kv.num_blocks
    with pytest.raises(ValueError, match=r"num_draft_layers must be in \[1, 3\]"):
        LLM(
            str(target_dir),
            speculative_config={"method": "layer_skip", "num_draft_layers": 4,
                                "num_speculative_tokens": 3},
        )  # fmt: skip


def test_chunked_prefill_and_preemption(target_dir):
    """The draft's own prompt chunks (a budget of 32 tokens a step) and a tiny target pool that
    preempts: the draft's blocks go with the target's, and the answer is the same."""
    long_prompt = " ".join(PROMPTS) * 3
    prompts = [long_prompt, *PROMPTS]
    want = _answers(LLM(str(target_dir), max_num_seqs=4).generate(prompts, _greedy(40)))
    llm = LLM(
        str(target_dir), max_num_seqs=4, max_num_batched_tokens=32, num_blocks=20, block_size=16,
        speculative_config={"model": str(target_dir), "num_speculative_tokens": 3},
    )  # fmt: skip
    assert _answers(llm.generate(prompts, _greedy(40))) == want
    assert llm.engine.totals.num_preemptions > 0
    assert llm.engine.totals.spec_num_accepted_tokens > 0
    assert _all_free(llm)


def test_abort_mid_verification_frees_target_and_draft_blocks(target_dir, draft_dir):
    llm = LLM(
        str(target_dir), max_num_seqs=4,
        speculative_config={"model": str(draft_dir), "num_speculative_tokens": 4},
    )  # fmt: skip
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", engine.tokenizer.encode(prompt), _greedy(64))
    for _ in range(200):
        drafts = engine.totals.spec_num_drafts
        engine.step()
        if engine.totals.spec_num_drafts > drafts:
            break
    assert engine.totals.spec_num_drafts > 0, "no verification step happened"
    assert _drafter(llm).kv.num_free_blocks < _drafter(llm).kv.num_blocks  # the draft holds KV
    for i in range(len(PROMPTS)):
        engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished_requests()
    assert _all_free(llm)


def test_a_draft_with_another_tokenizer_is_a_clear_start_up_error(target_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(target_dir, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: not the same tokenizer
    (other / "tokenizer.json").write_text(json.dumps(data))
    (other / "vocab.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="draft model's tokenizer differs from the target's"):
        LLM(str(target_dir), speculative_config={"model": str(other), "num_speculative_tokens": 3})


def test_a_draft_whose_embedding_misses_target_tokens_or_that_is_absent_fails_at_start_up(
    target_dir, smollm2_dir, tmp_path
):
    from engine.core.errors import StartupError

    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    small = save_tiny_checkpoint(_llama(vocab - 64, 2, 64), tmp_path / "small", smollm2_dir)
    spec = {"model": str(small), "num_speculative_tokens": 3}
    with pytest.raises(StartupError, match=f"{vocab - 64} rows, fewer than the target's .*{vocab}"):
        LLM(str(target_dir), speculative_config=spec)
    spec = {"model": str(tmp_path / "nonexistent"), "num_speculative_tokens": 3}
    with pytest.raises(StartupError, match="speculative draft model '.*nonexistent' not found"):
        LLM(str(target_dir), speculative_config=spec)


def test_layer_skip_drafts_are_the_truncated_models_greedy_tokens(target_dir, monkeypatch):
    """The layer-skip draft is the target's first N layers, then its final norm and LM head, over
    the target's KV of those layers: its drafts are what transformers' model cut to those layers
    generates greedily (float32), so the KV it reads is right."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.executor.draft_model import SharedKVDrafter

    seen: list[tuple[list[int], list[int]]] = []
    real = SharedKVDrafter.propose

    def recording(self, wants):
        out = real(self, wants)
        for seq, _ in wants:
            if seq.seq_id in out:
                seen.append((list(seq.token_ids), out[seq.seq_id]))
        return out

    monkeypatch.setattr(SharedKVDrafter, "propose", recording)
    llm = LLM(
        str(target_dir), quantization="none", max_num_seqs=4,
        speculative_config={"method": "layer_skip", "num_draft_layers": 2, "num_speculative_tokens": 4},
    )  # fmt: skip
    llm.generate(PROMPTS[:2], _greedy(12))
    assert len(seen) >= 2
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf.model.layers = hf.model.layers[:2]
    hf.config.num_hidden_layers = 2
    for context, drafts in seen[:4]:
        ids = torch.tensor([context])
        out = hf.generate(
            ids, max_new_tokens=len(drafts), do_sample=False, attention_mask=torch.ones_like(ids)
        )
        assert out[0, len(context) :].tolist() == drafts


def test_n_samples_seeded_sampling_and_structured_outputs(target_dir, draft_dir):
    """With a draft model: n=2 greedy, seeded sampling (the same text with and without), and a
    regex constraint (drafts cut by the grammar) all give plain decoding's answers."""
    from engine import StructuredOutputs

    base = LLM(str(target_dir), max_num_seqs=8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=5, n=2, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=16,
            structured_outputs=StructuredOutputs(regex=r"(ab){2,6}c"),
        ),
    ]  # fmt: skip
    prompts = [PROMPTS[0], PROMPTS[1], "abababababc ababc abab"]
    want = _answers(base.generate(prompts, params))
    for draft in (target_dir, draft_dir):
        llm = LLM(
            str(target_dir), max_num_seqs=8,
            speculative_config={"model": str(draft), "num_speculative_tokens": 3},
        )  # fmt: skip
        assert _answers(llm.generate(prompts, params)) == want, draft
        assert llm.engine.totals.spec_num_accepted_tokens > 0 or draft == draft_dir
        assert _all_free(llm)
