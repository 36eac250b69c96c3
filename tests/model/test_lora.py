"""LoRA adapters over a tiny random Llama against transformers + peft in float32: greedy tokens of
each adapter alone and in steps that mix three adapters and the base model, with chunked prefill,
forced preemption and prefix-cache hits; prompt logprobs and scores; speculative decoding; a
reloaded name never reuses the old adapter's KV; `max_loras` per step; deferred unloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, LoRANotFoundError, SamplingParams
from tests.model import tiny_models as tm
from tests.model.lora_adapters import (
    peft_greedy,
    peft_logprobs,
    peft_reference,
    save_three_adapters,
    save_tiny_base,
)

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = [3, 17, 30, 45, 9, 52, 24, 38]


@pytest.fixture(scope="module")
def base(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_base(smollm2_dir, tmp_path_factory.mktemp("lora_base"))


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_three_adapters(base, tmp_path_factory.mktemp("lora_adapters"))


@pytest.fixture(scope="module")
def prompts(base: Path) -> list[list[int]]:
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    return tm.random_prompts(vocab, LENGTHS, seed=5)


@pytest.fixture(scope="module")
def expected(
    base: Path, adapters: dict[str, Path], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    """Per adapter (None: the base model), transformers + peft's greedy tokens of every prompt."""
    refs: dict[str | None, list[list[int]]] = {None: peft_greedy(base, None, prompts, MAX_NEW)}
    for name, folder in adapters.items():
        refs[name] = peft_greedy(base, folder, prompts, MAX_NEW)
        assert refs[name] != refs[None], f"adapter {name} must change the tokens"
    return refs


def _llm(base: Path, adapters: dict[str, Path], **options: Any) -> LLM:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    defaults: dict[str, Any] = {"quantization": "none", "block_size": tm.BLOCK}
    return LLM(str(base), dtype="float32", lora_modules=modules, **(defaults | options))


def _greedy(llm: LLM, prompts: list[list[int]], loras: list[str | None]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, lora=loras)]


def _mix(n: int) -> list[str | None]:
    cycle: list[str | None] = ["all", "attn", None, "mlp"]
    return [cycle[i % len(cycle)] for i in range(n)]


def test_each_adapter_alone_matches_peft_unmerged_and_merged(base, adapters, prompts, expected):
    llm = _llm(base, adapters, max_num_seqs=8)
    for name, folder in adapters.items():
        got = _greedy(llm, prompts, [name] * len(prompts))
        assert got == expected[name], name
        merged = tm.hf_greedy(peft_reference(base, folder, merged=True), prompts[:3], MAX_NEW)
        assert got[:3] == merged, f"{name} vs the merged model"
    assert _greedy(llm, prompts, [None] * len(prompts)) == expected[None]


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 24, "enable_prefix_caching": False},  # chunked prefills
        {"max_num_batched_tokens": 64, "num_blocks": 12, "enable_prefix_caching": False},
    ],
    ids=["chunked", "preempted"],
)
def test_steps_mixing_three_adapters_and_the_base_model(base, adapters, prompts, expected, options):
    llm = _llm(base, adapters, max_num_seqs=8, **options)
    steps: list[set[int | None]] = []
    execute = llm.engine.runner.execute

    def recording(sched: Any, eos: frozenset[int]) -> Any:
        steps.append({s.seq.group.lora_id for s in sched.scheduled})
        return execute(sched, eos)

    llm.engine.runner.execute = recording  # type: ignore[method-assign]
    loras = _mix(len(prompts))
    got = _greedy(llm, prompts, loras)
    for i, (name, tokens) in enumerate(zip(loras, got, strict=True)):
        assert tokens == expected[name][i], f"prompt {i} on {name}"
    assert any(len(s) == 4 for s in steps), "a step must mix all three adapters and the base"
    if "num_blocks" in options:
        assert llm.engine.totals.num_preemptions > 0
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_max_loras_limits_the_adapters_of_a_step(base, adapters, prompts, expected):
    llm = _llm(base, adapters, max_num_seqs=8, max_loras=2)
    steps: list[set[int]] = []
    execute = llm.engine.runner.execute

    def recording(sched: Any, eos: frozenset[int]) -> Any:
        steps.append({s.seq.group.lora_id for s in sched.scheduled} - {None})
        return execute(sched, eos)

    llm.engine.runner.execute = recording  # type: ignore[method-assign]
    loras = _mix(len(prompts))
    got = _greedy(llm, prompts, loras)
    assert all(len(s) <= 2 for s in steps)
    assert any(len(s) == 2 for s in steps)
    for i, (name, tokens) in enumerate(zip(loras, got, strict=True)):
        assert tokens == expected[name][i]


def test_prefix_cache_hits_stay_within_an_adapter(base, adapters, prompts):
    shared = prompts[5][: 3 * tm.BLOCK]
    batch = [shared + p[:10] for p in prompts[:3]]
    refs = {n: peft_greedy(base, adapters[n], batch, MAX_NEW) for n in ("all", "attn")}
    llm = _llm(base, adapters, max_num_batched_tokens=40)
    assert _greedy(llm, batch[:1], ["all"]) == refs["all"][:1]
    hits = llm.engine.totals.prefix_cache_hits
    # Another adapter, the same tokens: its KV differs, nothing may come from the cache.
    assert _greedy(llm, batch[:1], ["attn"]) == refs["attn"][:1]
    assert llm.engine.totals.prefix_cache_hits == hits
    # The same adapter again: the shared blocks are reused, the tokens unchanged.
    assert _greedy(llm, batch[1:], ["all", "all"]) == refs["all"][1:]
    assert llm.engine.totals.prefix_cache_hits >= hits + 2 * len(shared)


def test_a_reloaded_name_never_uses_the_old_adapter_s_blocks(base, adapters, prompts):
    prompt = prompts[5]
    llm = _llm(base, {"x": adapters["all"]})
    _greedy(llm, [prompt], ["x"])
    old_hash = llm.engine.loras()[0].content_hash
    llm.engine.unload_lora("x")
    info = llm.engine.load_lora("x", str(adapters["mlp"]))
    assert info.content_hash != old_hash
    hits = llm.engine.totals.prefix_cache_hits
    assert _greedy(llm, [prompt], ["x"]) == peft_greedy(base, adapters["mlp"], [prompt], MAX_NEW)
    assert llm.engine.totals.prefix_cache_hits == hits
    # Reloading the same weights under a new name shares their KV: keyed by content, not name.
    llm.engine.load_lora("y", str(adapters["mlp"]))
    _greedy(llm, [prompt], ["y"])
    assert llm.engine.totals.prefix_cache_hits > hits


def test_prompt_logprobs_and_scores_match_peft(base, adapters, prompts):
    llm = _llm(base, adapters, max_num_batched_tokens=24)  # logprobs come chunk by chunk
    prompt = prompts[5]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), lora="attn")[0]
    ref = peft_logprobs(base, adapters["attn"], prompt)
    plp = out.prompt_logprobs
    assert plp is not None
    worst = max(
        abs(plp[pos].logprob - ref[pos - 1, prompt[pos]].item()) for pos in range(1, len(prompt))
    )
    assert worst < tm.LOGPROB_TOLERANCE, worst
    context, choice = prompt[:30], prompt[30:]
    result = llm.score(context, [choice], lora="attn")
    want = sum(ref[30 + i - 1, t].item() for i, t in enumerate(choice))
    assert abs(result.choices[0].logprob - want) < 1e-3


def test_speculative_verification_runs_the_adapter(base, adapters, prompts, expected):
    """Drafts that are the adapter's own next tokens (transformers + peft's) must all be accepted:
    verification rows run on the adapter (on the base model they would be rejected)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = _llm(base, adapters, speculative_config=spec, max_num_seqs=8)
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    index = {tuple(p): i for i, p in enumerate(prompts)}

    def propose(seq: Any, budget: int, batch_size: int = 1) -> list[int]:
        ref = expected[seq.group.lora_name][index[tuple(seq.token_ids[: seq.num_prompt_tokens])]]
        done = seq.num_output_tokens
        return ref[done : done + min(3, budget, MAX_NEW - done - 1)]

    speculator.propose = propose  # type: ignore[method-assign]
    loras = _mix(len(prompts))
    got = _greedy(llm, prompts, loras)
    for i, (name, tokens) in enumerate(zip(loras, got, strict=True)):
        assert tokens == expected[name][i]
    totals = llm.engine.totals
    assert totals.spec_num_draft_tokens > 0
    assert totals.spec_num_accepted_tokens == totals.spec_num_draft_tokens


def test_unload_waits_for_running_requests(base, adapters, prompts, expected):
    llm = _llm(base, adapters)
    engine = llm.engine
    engine.add_request("r", prompts[1], GREEDY, lora="mlp")
    engine.step()
    lora_id = engine.groups["r"].lora_id
    engine.unload_lora("mlp")
    assert "mlp" not in [i.name for i in engine.loras()]
    with pytest.raises(LoRANotFoundError) as err:
        engine.add_request("s", prompts[1], GREEDY, lora="mlp")
    assert err.value.name == "mlp" and set(err.value.served) == {"all", "attn"}
    assert lora_id in engine.adapters.by_id  # still pinned by "r"
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert list(outputs[0].outputs[0].token_ids) == expected["mlp"][1]
    assert lora_id not in engine.adapters.by_id  # freed after its last request


def test_snapshot_names_each_request_s_adapter(base, adapters, prompts):
    llm = _llm(base, adapters, max_loras=1)
    engine = llm.engine
    engine.add_request("a", prompts[0], GREEDY, lora="all")
    engine.add_request("b", prompts[1], GREEDY, lora="attn")
    engine.add_request("c", prompts[2], GREEDY)
    engine.step()
    assert engine.snapshot.requests == ()  # the per-step snapshot has counts only
    snap = engine.publish(detail=True)
    assert {r.request_id: r.lora for r in snap.requests} == {"a": "all", "b": "attn", "c": None}
    assert snap.running_loras == ("all",) and snap.waiting_loras == ("attn",)
    assert snap.max_loras == 1
    for rid in ("a", "b", "c"):
        engine.abort_request(rid)
    assert not engine.adapters.pins


def test_structured_output_and_streaming_on_an_adapter(base, adapters):
    from engine import StructuredOutputs

    llm = _llm(base, adapters)
    choices = ("alpha beta", "gamma", "delta epsilon zeta")
    params = SamplingParams(
        temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputs(choice=choices)
    )
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], params, lora=["all", "mlp"])
    assert all(o.outputs[0].text in choices for o in outs)
    # Delta outputs of a request on an adapter add up to its whole answer.
    engine = llm.engine
    stream = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind="delta")
    engine.add_request("s", [5, 6, 7, 8], stream, lora="attn")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    whole = llm.generate([[5, 6, 7, 8]], GREEDY, lora="attn")[0].outputs[0].token_ids
    assert tokens == list(whole)[:6]
