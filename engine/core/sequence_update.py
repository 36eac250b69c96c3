"""What one runner output does to one scheduled sequence (no torch): its prompt logprob rows, its
appended tokens (accepted drafts first, then the sampled one), its grammar matcher, the stop rules
(stop tokens, EOS, stop strings, a finished constraint, lengths), its request's metrics, and the
step's token counts. It decides how the sequence ends; the scheduler, which owns sequence state,
finishes it (see Scheduler.update_from_output)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.core.errors import ConstraintError, InvalidRequestError
from engine.core.outputs import TokenLogprob
from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.runner_output import RunnerOutput
from engine.core.stats import FinishedRequestStats, StepStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    """The whole request fails: `message` for its output, `fault` when it is the request's fault."""

    message: str
    fault: InvalidRequestError | None = None


# How a sequence ends in this step: a finished status, a failure of its request, or None (it goes on).
Ending = SequenceStatus | Failure | None


class SequenceUpdater:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append_sampled(
        self,
        seq: Sequence,
        draft_token_ids: list[int],
        result: RunnerOutput,
        now: float,
        stats: StepStats,
    ) -> Ending:
        """Append what the runner sampled for `seq` (its accepted drafts, then the token after them);
        tokens after one that ends the sequence are not appended."""
        if draft_token_ids:
            ending = self._append_accepted(seq, draft_token_ids, result, now, stats)
            if ending is not None:
                return ending  # a stop among the accepted tokens: nothing after it is emitted
        return self._append_token(
            seq, result.sampled[seq.seq_id], result.logprobs.get(seq.seq_id), now, stats
        )

    def _append_accepted(
        self,
        seq: Sequence,
        draft_token_ids: list[int],
        result: RunnerOutput,
        now: float,
        stats: StepStats,
    ) -> Ending:
        """Append a verified sequence's accepted draft tokens, counting the verification; not None
        when one of them ended the sequence."""
        accepted = result.num_accepted.get(seq.seq_id, 0)
        proposed = len(draft_token_ids)
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += proposed
        stats.spec_num_accepted_tokens += accepted
        per_position = stats.spec_accepted_per_position
        per_position.extend([0] * (proposed - len(per_position)))
        for j in range(accepted):
            per_position[j] += 1
        seq.group.metrics.num_draft_tokens += proposed
        seq.group.metrics.num_accepted_tokens += accepted
        logprobs = result.draft_logprobs.get(seq.seq_id)
        for j in range(accepted):
            lp = logprobs[j] if logprobs is not None else None
            ending = self._append_token(seq, draft_token_ids[j], lp, now, stats)
            if ending is not None:
                return ending
        return None

    def _append_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: TokenLogprob | None,
        now: float,
        stats: StepStats,
    ) -> Ending:
        group, params = seq.group, seq.params
        seq.append_token(token_id)
        stats.num_generation_tokens += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
            seq.cumulative_logprob += logprob.logprob
        m = group.metrics
        m.num_generation_tokens += 1
        if m.first_token_time is None:
            m.first_token_time = now
            stats.first_tokens.append((group.request_id, now - m.arrival_time))
        elif m.last_token_time is not None and seq.index == 0:
            stats.inter_token_latencies.append(now - m.last_token_time)
            m.num_token_gaps += 1
        if seq.index == 0:
            m.last_token_time = now

        matcher = seq.matcher
        if matcher is not None and (
            matcher.is_error() or (not matcher.is_stopped() and not matcher.consume_token(token_id))
        ):
            # The mask allowed only grammar tokens, so the matcher gave up (a limit of llguidance's,
            # such as a regex that builds too many states): this request alone fails, blamed on it.
            return constraint_failure(group, matcher.get_error())
        if token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        assert seq.detokenizer is not None
        try:
            stop = seq.detokenizer.add_tokens([token_id])
        except Exception as e:  # a detokenizer fault fails this request only
            logger.exception("detokenizer failed for %s", seq.seq_id)
            return Failure(f"detokenization failed: {e}")
        if stop is not None:
            seq.stop_reason = stop
            return SequenceStatus.FINISHED_STOPPED
        if matcher is not None and matcher.is_stopped():
            return SequenceStatus.FINISHED_STOPPED  # the constraint is complete
        if seq.num_output_tokens >= group.max_output_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None


def constraint_failure(group: RequestGroup, why: str) -> Failure:
    """The request fails on its constraint (masked every token, or the matcher gave up), blamed on
    the constraint's own field."""
    constraint = group.requested.structured_outputs
    source = constraint.source if constraint is not None else "structured_outputs"
    why = why.strip().splitlines()[0] if why.strip() else "unknown error"
    fault = ConstraintError(why, source)
    return Failure(str(fault), fault)


def store_prompt_logprobs(seq: Sequence, first: int, rows: list[TokenLogprob]) -> None:
    """Rows for positions first.. (a recompute after preemption sends some again): a score
    sequence keeps its choice's, the leader of an echo request the prompt's."""
    group = seq.group
    if seq.score_start is not None:
        at = first - seq.score_start
        assert 0 <= at <= len(seq.logprobs), "score rows arrive in order"
        seq.logprobs[at : at + len(rows)] = rows
        seq.cumulative_logprob = sum(lp.logprob for lp in seq.logprobs)
    elif group.prompt_logprobs is not None:
        group.prompt_logprobs[first : first + len(rows)] = rows


def finished_stats(group: RequestGroup, now: float) -> FinishedRequestStats:
    """A finished request's record for the step's stats (stamps its finish time)."""
    m = group.metrics
    m.finished_time = now
    reason = group.seqs[0].status.finish_reason
    assert reason is not None, "only a finished request has finished stats"
    return FinishedRequestStats(
        group.request_id,
        "error" if group.error else reason,
        group.num_prompt_tokens,
        sum(s.num_output_tokens for s in group.seqs),
        group.num_cached_tokens,
        m.arrival_time,
        m.first_scheduled_time,
        m.first_token_time,
        now,
        kind=group.kind,
        lora=group.lora_name,
    )
