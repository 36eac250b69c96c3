"""Speculative decoding (ngram) never changes the answer: greedy tokens and their logprobs are the same
with and without it (alone, in mixed batches, with chunked prefill, preemption, prefix-cache hits, stop
strings inside accepted runs, penalties, n > 1), seeded sampling gives the same text, and aborting
mid-verification leaves every KV block free."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams, StructuredOutputs
from engine.core import speculator
from engine.core.sequence_update import SequenceUpdater
from engine.kernels import cpu_kernels

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built"),
    pytest.mark.usefixtures("fixed_spec_cost"),  # drafts proposed whatever the machine's speed
]

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 16}
COPY_PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "one two three four five six seven one two three four five six seven one two three",
]
PLAIN_PROMPTS = ["Hello, my name is", "The capital of France is"]


def _greedy(max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, **kw)  # type: ignore[arg-type]


def _answers(outs):
    return [
        [
            (list(c.token_ids), c.text, [(t.logprob, t.top) for t in c.logprobs or []])
            for c in o.outputs
        ]
        for o in outs
    ]


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_num_seqs=8)


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_num_seqs=8, speculative_config=SPEC)


def _accepted(llm: LLM) -> int:
    return llm.engine.totals.spec_num_accepted_tokens


def test_greedy_identical_alone_and_in_a_mixed_batch(base, spec):
    before = _accepted(spec)
    drafted = spec.engine.totals.spec_num_draft_tokens
    prompts = COPY_PROMPTS + PLAIN_PROMPTS
    expected = _answers(base.generate(prompts, _greedy()))
    assert _answers(spec.generate(prompts, _greedy())) == expected  # mixed batch
    for prompt, want in zip(prompts, expected, strict=True):
        assert _answers(spec.generate([prompt], _greedy())) == [want]  # alone
    assert _accepted(spec) > before, "the copy prompts should have had drafts accepted"
    rejected = spec.engine.totals.spec_num_draft_tokens - drafted - (_accepted(spec) - before)
    assert rejected > 0, "some drafts should have been rejected (their KV rolled back)"


def test_greedy_identical_with_penalties_and_max_tokens(base, spec):
    params = [
        _greedy(max_tokens=n, repetition_penalty=1.3, min_tokens=min(n, 4)) for n in (1, 2, 5, 9)
    ] + [_greedy(max_tokens=7, frequency_penalty=0.5, presence_penalty=0.3)]
    prompts = [COPY_PROMPTS[i % 3] for i in range(len(params))]
    assert _answers(spec.generate(prompts, params)) == _answers(base.generate(prompts, params))
    for out, p in zip(spec.generate(prompts, params), params, strict=True):
        assert len(out.outputs[0].token_ids) == p.max_tokens


def test_chunked_prefill_preemption_and_prefix_hits(tiny_llama_dir, base):
    long_prompt = " ".join(COPY_PROMPTS) * 3
    prompts = [long_prompt, *COPY_PROMPTS]
    expected = _answers(base.generate(prompts, _greedy(48)))
    tiny = LLM(
        str(tiny_llama_dir), max_num_seqs=4, max_num_batched_tokens=32, num_blocks=24,
        block_size=16, speculative_config=SPEC,
    )  # fmt: skip
    assert _answers(tiny.generate(prompts, _greedy(48))) == expected
    assert tiny.engine.totals.num_preemptions > 0, "the tiny pool should force preemption"
    assert _accepted(tiny) > 0
    again = tiny.generate(prompts[1:2], _greedy(48))  # its prompt blocks are cached now
    assert again[0].num_cached_tokens > 0
    assert _answers(again) == expected[1:2]
    assert tiny.engine.kv.num_free_blocks == tiny.engine.kv.num_blocks


def test_stop_strings_inside_accepted_runs(base, spec, monkeypatch):
    stopped_in_run = []
    real = SequenceUpdater._append_accepted

    def recording(self, *args):
        ending = real(self, *args)
        stopped_in_run.append(ending is not None)
        return ending

    monkeypatch.setattr(SequenceUpdater, "_append_accepted", recording)
    full = base.generate(COPY_PROMPTS, _greedy(40))
    for out in full:
        text = out.outputs[0].text
        for cut in range(6, len(text) - 2, 5):
            stop = text[cut : cut + 2]
            if not stop.strip():
                continue
            p = _greedy(40, stop=[stop])
            want = _answers(base.generate([out.prompt], p))
            got = _answers(spec.generate([out.prompt], p))
            assert got == want, stop
            assert stop not in got[0][0][1]
    assert any(stopped_in_run), "no stop string fell inside an accepted run"


def test_greedy_n_samples_identical(base, spec):
    greedy_n = SamplingParams(temperature=0.0, max_tokens=20, n=2, ignore_eos=True, logprobs=1)
    want = _answers(base.generate(COPY_PROMPTS, greedy_n))
    assert _answers(spec.generate(COPY_PROMPTS, greedy_n)) == want


JSON_PROMPT = (
    'Records: {"name": "Ada", "id": 7} {"name": "Bob", "id": 8} {"name": "Cy", "id": 9} '
    '{"name": "Ada", "id": 7} {"name": "'
)
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "id": {"type": "integer", "maximum": 99},
        },
        "required": ["name", "id"],
        "additionalProperties": False,
    }
)


@pytest.mark.parametrize("method", [SPEC, SUFFIX])
def test_constrained_requests_speculate_with_grammar_cut_drafts(
    base, tiny_llama_dir, method, monkeypatch
):
    """Structured outputs speculate too: a proposal is cut where the grammar rejects it, each
    verified row is masked by the grammar after the drafts before it, and the answer is the same
    as without speculation (a JSON schema and a regex, beside an unconstrained request)."""
    cuts = []
    real_cut = speculator.grammar_cut

    def recording(matcher, drafts):
        kept = real_cut(matcher, drafts)
        cuts.append((len(drafts), len(kept)))
        return kept

    monkeypatch.setattr(speculator, "grammar_cut", recording)
    llm = LLM(str(tiny_llama_dir), max_num_seqs=8, speculative_config=method)
    params = [
        _greedy(40, structured_outputs=StructuredOutputs(json=SCHEMA)),
        _greedy(24, structured_outputs=StructuredOutputs(regex=r"(ab){2,6}c")),
        _greedy(),
    ]
    prompts = [JSON_PROMPT, "abababababc ababc abababc abab", COPY_PROMPTS[0]]
    want = _answers(base.generate(prompts, params))
    assert want[0][0][1].startswith('{"name": "') and set(want[1][0][1]) <= set("abc")
    for _ in range(2):  # the second round: the suffix cache knows the answers
        assert _answers(llm.generate(prompts, params)) == want
    before = llm.engine.totals.spec_num_accepted_tokens
    assert _answers(llm.generate(prompts[:2], params[:2])) == want[:2]  # constrained only
    assert llm.engine.totals.spec_num_accepted_tokens > before, "constrained drafts accepted"
    assert any(kept < proposed for proposed, kept in cuts), "no draft was cut by the grammar"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_other_weight_formats(tiny_llama_dir, quantization):
    """int4 blocks are row-invariant too: identical. Float weights: the matmul library's results
    depend on the row count, so only agreement on these prompts is checked, not promised."""
    kw = {"quantization": quantization, "max_num_seqs": 4}
    want = _answers(LLM(str(tiny_llama_dir), **kw).generate(COPY_PROMPTS, _greedy()))
    got = LLM(str(tiny_llama_dir), speculative_config=SPEC, **kw).generate(COPY_PROMPTS, _greedy())
    if quantization == "none":  # tokens only: float logprobs may differ in the last bits
        assert [[c[0] for c in o] for o in _answers(got)] == [[c[0] for c in o] for o in want]
    else:
        assert _answers(got) == want


def test_abort_mid_verification_frees_every_block(spec):
    engine = spec.engine
    for i, prompt in enumerate(COPY_PROMPTS):
        engine.add_request(f"abort-{i}", engine.tokenizer.encode(prompt), _greedy(64))
    verified = False
    for _ in range(200):
        sched_drafts = engine.totals.spec_num_drafts
        engine.step()
        if engine.totals.spec_num_drafts > sched_drafts:
            verified = True
            break
    assert verified, "no verification step happened"
    assert engine.snapshot.spec_num_drafts == engine.totals.spec_num_drafts > 0
    for i in range(len(COPY_PROMPTS)):
        engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.kv.block_tables


COPY_REQUEST = (
    "Repeat exactly the following text, word for word:\n"
    "Speculative decoding proposes several tokens at once and verifies them in one forward "
    "pass, so the answer never changes while the latency drops."
)


@pytest.fixture(scope="module")
def smol():
    base_llm = LLM(max_num_seqs=4)
    spec_llm = LLM(
        max_num_seqs=4,
        speculative_config={
            "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
    )  # fmt: skip
    ids = base_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": COPY_REQUEST}], add_generation_prompt=True
    )
    return base_llm, spec_llm, ids


def test_bundled_model_copies_identically(smol):
    base_llm, spec_llm, ids = smol
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=1)
    prompts = [ids, "The capital of France is"]
    before = spec_llm.engine.totals
    drafted, accepted = before.spec_num_draft_tokens, before.spec_num_accepted_tokens
    assert _answers(spec_llm.generate(prompts, params)) == _answers(
        base_llm.generate(prompts, params)
    )
    totals = spec_llm.engine.totals
    assert (
        totals.spec_num_accepted_tokens - accepted >= (totals.spec_num_draft_tokens - drafted) // 2
    )


def test_bundled_model_seeded_sampling_identical(smol):
    """Sampling (top-p, n=2, seeded): the same text with and without speculation, and some drafts
    rejected on the way (so the generator rewind is exercised)."""
    base_llm, spec_llm, ids = smol
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=11, n=2, logprobs=1)
    before = spec_llm.engine.totals
    drafted, accepted = before.spec_num_draft_tokens, before.spec_num_accepted_tokens
    want = _answers(base_llm.generate([ids], params))
    assert _answers(spec_llm.generate([ids], params)) == want
    totals = spec_llm.engine.totals
    assert 0 < totals.spec_num_accepted_tokens - accepted < totals.spec_num_draft_tokens - drafted


def test_sliding_window_model_identical(tmp_path, tiny_llama_dir):
    """A Mistral whose 16-token window is shorter than the prompts: drafts roll back in the
    sliding group's table too, and the answer stays the same."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    for f in tiny_llama_dir.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and not (tmp_path / f.name).exists():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    want = _answers(LLM(str(tmp_path), max_num_seqs=4).generate(COPY_PROMPTS, _greedy(40)))
    llm = LLM(str(tmp_path), max_num_seqs=4, speculative_config=SPEC)
    assert _answers(llm.generate(COPY_PROMPTS, _greedy(40))) == want
    assert _accepted(llm) > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_suffix_greedy_identical_and_other_requests_outputs_help(tiny_llama_dir, base):
    """Suffix decoding: identical greedy answers (mixed batch, then alone); a prompt asked again
    gets its earlier answer proposed from the shared cache of outputs, so nearly every draft of
    the second run is accepted, and long ones."""
    llm = LLM(str(tiny_llama_dir), max_num_seqs=8, speculative_config=SUFFIX)
    prompts = COPY_PROMPTS + PLAIN_PROMPTS
    expected = _answers(base.generate(prompts, _greedy(40)))
    assert _answers(llm.generate(prompts, _greedy(40))) == expected
    t = llm.engine.totals
    drafted, accepted, drafts = (
        t.spec_num_draft_tokens,
        t.spec_num_accepted_tokens,
        t.spec_num_drafts,
    )
    assert accepted > 0
    for prompt, want in zip(prompts, expected, strict=True):
        assert _answers(llm.generate([prompt], _greedy(40))) == [want]
    t = llm.engine.totals
    again_drafted, again_accepted = (
        t.spec_num_draft_tokens - drafted,
        t.spec_num_accepted_tokens - accepted,
    )
    assert again_accepted >= 0.9 * again_drafted, (again_accepted, again_drafted)
    assert again_accepted / (t.spec_num_drafts - drafts) > 3  # long accepted runs
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_engine_page_marks_verification_steps(spec):
    """The detailed snapshot's steps carry each step's verified and accepted draft tokens, and the
    /engine page payload sends them with the step."""
    from server.engine_page import page_payload

    spec.generate(COPY_PROMPTS[:1], _greedy(24))
    steps = spec.engine.build_snapshot(detail=True).detail.steps
    verified = [s for s in steps if s.num_draft_tokens]
    assert verified and any(s.num_accepted_tokens for s in verified)
    assert all(
        0 <= s.num_accepted_tokens <= s.num_draft_tokens <= s.num_prefill_tokens for s in steps
    )
    payload = page_payload(spec.engine.build_snapshot(detail=True), {})
    rows = {row[0]: row for row in payload["steps"]}
    for s in verified:
        assert rows[s.step][7:9] == [s.num_draft_tokens, s.num_accepted_tokens]
