"""Scoring without a model: a score group's scheduling (the context computed once, followers holding
its blocks by reference, logprob rows over the choice only), the score summary, and /v1/score's 400s."""

from __future__ import annotations

import math

import httpx
import pytest

from engine import CompletionOutput, RequestOutput, TokenLogprob, summarize_scores
from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestGroup, SequenceStatus
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler import Scheduler
from engine.core.scoring import softmax
from server.app import build_app
from server.state import ServerConfig
from tests.unit.server_fakes import FakeEngine


def finish_step(sched: Scheduler) -> list:
    """Schedule, pretend the model ran (nothing is sampled for a score group): the scheduler
    releases the followers and finishes each choice once its prompt is in."""
    out = sched.schedule()
    assert not any(s.needs_sample for s in out.scheduled)
    sched.update_from_output(out, RunnerOutput())
    for s in out.scheduled:
        if s.seq.is_prefill_done:
            assert s.seq.status is SequenceStatus.FINISHED_LENGTH
    return out.scheduled


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_score_group_computes_the_context_once(prefix_caching: bool) -> None:
    kv = KVCacheManager(64, 4, enable_prefix_caching=prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    context = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    choices = [[1, 2, 3], [4], [5, 6]]
    group = RequestGroup.for_scoring("s", context, choices)
    sched.add_group(group)
    (leader,) = finish_step(sched)
    assert leader.num_new_tokens == 13 and leader.prompt_logprobs_rows == 3
    assert leader.prompt_logprobs_offset == 9  # rows from the context's last token
    followers = finish_step(sched)
    assert [s.seq.index for s in followers] == [1, 2]
    # Each follower starts after the two shared blocks: the context's last 2 tokens, then its choice.
    assert [(s.start_pos, s.num_new_tokens) for s in followers] == [(8, 3), (8, 4)]
    assert [(s.prompt_logprobs_offset, s.prompt_logprobs_rows) for s in followers] == [
        (1, 1),
        (1, 2),
    ]
    assert all(s.block_tables[0][:2] == leader.block_tables[0][:2] for s in followers)
    assert group.finished and kv.num_free_blocks == 64
    assert group.num_prompt_tokens == 10 + 6
    if prefix_caching:
        assert kv.stats.queries == 13  # the leader's lookup; followers share without one


def test_a_scored_position_is_never_served_from_the_cache() -> None:
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    context = list(range(100, 108))  # exactly 2 blocks
    sched.add_group(RequestGroup.for_scoring("a", context, [[1, 2]]))
    finish_step(sched)
    again = RequestGroup.for_scoring("b", context, [[3]])
    sched.add_group(again)
    (s,) = finish_step(sched)
    # The block holding the context's last token is recomputed: its logits score the choice.
    assert s.start_pos == 4 and again.num_cached_tokens == 4
    assert (s.prompt_logprobs_offset, s.prompt_logprobs_rows) == (3, 1)


def output(choices: list[list[tuple[float, int]]]) -> RequestOutput:
    """A finished score output: per choice, (logprob, rank) of each of its tokens."""
    outs = [
        CompletionOutput(
            i,
            "",
            list(range(len(c))),
            [TokenLogprob(t, lp, rank, [(7, -0.1), (8, -2.0)]) for t, (lp, rank) in enumerate(c)],
        )
        for i, c in enumerate(choices)
    ]
    return RequestOutput("r", None, [1, 2, 3], outs, True, num_cached_tokens=2)


def test_summary_normalizes_by_sum_or_mean_and_reads_greedy_from_ranks() -> None:
    out = output([[(-1.0, 1), (-1.0, 1)], [(-1.5, 2)]])
    by_sum = summarize_scores(out, ["ab", "c"], "sum", num_top=1)
    assert [c.logprob for c in by_sum.choices] == [-2.0, -1.5]
    assert [c.mean_logprob for c in by_sum.choices] == [-1.0, -1.5]
    assert [c.is_greedy for c in by_sum.choices] == [True, False]
    p = 1 / (1 + math.exp(-0.5))
    assert by_sum.choices[1].probability == pytest.approx(p)
    assert by_sum.best.index == 1 and by_sum.top_logprobs == [(7, -0.1)]
    assert by_sum.num_prompt_tokens == 3 + 3 and by_sum.num_cached_tokens == 2
    by_mean = summarize_scores(out, ["ab", "c"], "mean")
    assert by_mean.best.index == 0 and by_mean.top_logprobs == []
    assert by_mean.choices[0].probability == pytest.approx(p)
    assert softmax([-math.inf, -math.inf]) == [0.5, 0.5]
    assert sum(softmax([-1000.0, -1001.0, 3.0])) == pytest.approx(1.0)


async def _post(engine: object, body: dict, **config: object) -> httpx.Response:
    app = build_app(ServerConfig(**config), engine)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/score", json=body)


async def test_an_embedding_server_and_too_many_choices_are_400s() -> None:
    embedder = FakeEngine()
    embedder.task = "embed"
    r = await _post(embedder, {"prompt": "x", "choices": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task"
    r = await _post(FakeEngine(), {"prompt": "x", "choices": ["a", "b", "c"]}, max_score_choices=2)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "choices" and "at most 2" in r.json()["error"]["message"]


def test_finished_requests_are_counted_by_kind() -> None:
    from engine.core.stats import FinishedRequestStats, StepStats
    from server.metrics import ServerMetrics
    from server.state import ServerState

    metrics = ServerMetrics(ServerState(ServerConfig()))
    finished = [
        FinishedRequestStats("a", "length", 16, 0, 0, 1.0, 1.1, None, 2.0, kind="score"),
        FinishedRequestStats("b", "stop", 5, 3, 0, 1.0, 1.1, 1.5, 2.0),
        FinishedRequestStats("c", "abort", 9, 0, 0, 1.0, 1.1, None, 2.0, kind="score"),
    ]
    metrics.on_step(StepStats("prefill", num_new_prompt_tokens=30, finished=finished))

    def value(**labels: str) -> float:
        return metrics.registry.get_sample_value("kvserve_requests_total", labels) or 0.0

    assert value(kind="score", finish_reason="length") == 1
    assert value(kind="score", finish_reason="abort") == 1
    assert value(kind="generate", finish_reason="stop") == 1
    assert value(kind="generate", finish_reason="length") == 0
    assert metrics.registry.get_sample_value("kvserve_prompt_tokens_total") == 30


def test_score_inputs_follow_lm_eval_and_the_chat_template(smollm2_dir) -> None:
    from engine import InvalidRequestError, Tokenizer
    from engine.text import build_score_inputs
    from engine.text.score_inputs import encode_pair

    tok = Tokenizer.from_pretrained(smollm2_dir)
    # lm-eval: the context's trailing whitespace joins the continuation.
    context, cont = encode_pair(tok, "The capital of France is ", "Paris")
    assert context == tok.encode("The capital of France is")
    assert (
        cont == tok.encode("The capital of France is Paris")[len(context) :] == tok.encode(" Paris")
    )
    # An empty context is the BOS token, as lm-eval's prefix token.
    assert encode_pair(tok, "", "Hello") == ([tok.hf.bos_token_id], tok.encode("Hello", False))
    messages = [{"role": "user", "content": "Hi"}]
    chat = build_score_inputs(tok, ["Hello", "Bye"], messages=messages, include_end_of_turn=True)
    assert chat.context_token_ids == tok.apply_chat_template(messages)
    assert chat.choice_token_ids[0] == tok.encode("Hello", False) + [2]  # 2: <|im_end|>
    assert chat.choice_texts == ["Hello", "Bye"]
    ids = build_score_inputs(tok, [[42]], messages=messages, include_end_of_turn=True)
    assert ids.choice_token_ids == [[42, 2]]
    by_ids = build_score_inputs(tok, [[5, 6]], prompt=[1, 2, 3])
    assert (by_ids.context_token_ids, by_ids.choice_token_ids) == ([1, 2, 3], [[5, 6]])
    bad = [
        ({"choices": ["a", [1]], "prompt": "x"}, "choices"),
        ({"choices": ["a", ""], "prompt": "x"}, "choices"),
        ({"choices": ["a"], "prompt": "x", "include_end_of_turn": True}, "include_end_of_turn"),
        ({"choices": ["a"]}, "prompt"),
    ]
    for kwargs, param in bad:
        with pytest.raises(InvalidRequestError) as info:
            build_score_inputs(tok, **kwargs)  # type: ignore[arg-type]
        assert info.value.param == param
