"""Score results (no torch): a score request's per-choice logprobs turned into what callers read —
total and mean logprob, the probability over the choices (softmax, by sum or by mean), and whether
greedy decoding would produce the choice."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from engine.core.outputs import RequestOutput

Normalize = Literal["sum", "mean"]
NORMALIZATIONS: tuple[str, ...] = ("sum", "mean")


@dataclass
class ChoiceScore:
    index: int
    text: str
    token_ids: list[int]  # the scored tokens (the end-of-turn token too, when asked for)
    token_logprobs: list[float]  # log P(token | context and the choice's tokens before it)
    logprob: float  # log P(choice | context): the sum of token_logprobs
    mean_logprob: float  # logprob / num_tokens
    probability: float  # softmax over the choices' logprob (or mean_logprob): they sum to 1
    is_greedy: bool  # every token is the most likely one at its position

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class ScoreResult:
    request_id: str
    choices: list[ChoiceScore]
    # The most likely first tokens after the context, (token id, logprob), best first.
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    num_prompt_tokens: int = 0  # context plus every choice's tokens
    num_cached_tokens: int = 0  # context tokens served from the prefix cache

    @property
    def best(self) -> ChoiceScore:
        return max(self.choices, key=lambda c: c.probability)


def summarize_scores(
    output: RequestOutput, texts: list[str], normalize: Normalize = "sum", num_top: int = 0
) -> ScoreResult:
    """The ScoreResult of a finished score request; `texts` names each choice as the caller gave it."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
    outs = sorted(output.outputs, key=lambda o: o.index)
    if len(outs) != len(texts):
        raise ValueError(f"got {len(texts)} choice texts for {len(outs)} scored choices")
    rows = []
    for out in outs:
        logprobs = out.logprobs or []
        if len(logprobs) != len(out.token_ids):
            raise ValueError(f"choice {out.index} was not fully scored")
        token_logprobs = [lp.logprob for lp in logprobs]
        total = math.fsum(token_logprobs)
        greedy = all(lp.rank == 1 for lp in logprobs)
        rows.append((out, token_logprobs, total, total / len(token_logprobs), greedy))
    weights = softmax([r[2] if normalize == "sum" else r[3] for r in rows])
    choices = [
        ChoiceScore(out.index, text, list(out.token_ids), lps, total, mean, p, greedy)
        for (out, lps, total, mean, greedy), text, p in zip(rows, texts, weights, strict=True)
    ]
    top: list[tuple[int, float]] = []
    if num_top > 0 and outs and outs[0].logprobs:
        top = list(outs[0].logprobs[0].top[:num_top])
    num_prompt = len(output.prompt_token_ids) + sum(len(c.token_ids) for c in choices)
    return ScoreResult(output.request_id, choices, top, num_prompt, output.num_cached_tokens)


def softmax(values: list[float]) -> list[float]:
    """Probabilities proportional to exp(value), computed without overflow; all -inf: uniform."""
    peak = max(values)
    if peak == -math.inf:
        return [1.0 / len(values)] * len(values)
    exps = [math.exp(v - peak) for v in values]
    total = math.fsum(exps)
    return [e / total for e in exps]
