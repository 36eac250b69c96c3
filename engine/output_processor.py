"""Turns a step's sampled tokens into request progress: appends tokens, advances grammar matchers,
applies the stop rules (EOS, stop tokens, stop strings, a finished constraint, lengths), detokenizes,
and builds RequestOutputs (final, delta or cumulative, with best_of ranking; a score request's choices
with their token logprobs)."""

from __future__ import annotations

import logging
import time

from engine.core.errors import ConstraintError, InvalidRequestError
from engine.core.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.core.stats import FinishedRequestStats, StepStats

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(
        self, scheduler: Scheduler, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def update(
        self, sched: SchedulerOutput, result: RunnerOutput, stats: StepStats
    ) -> list[RequestGroup]:
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for s in sched.scheduled:
            seq, group = s.seq, s.seq.group
            if seq.status.finished:
                continue
            touched[group.request_id] = group
            if seq.seq_id in result.prompt_logprobs:
                self._store_prompt_logprobs(seq, *result.prompt_logprobs[seq.seq_id])
            if seq.seq_id in result.errors:
                if seq.matcher is not None and seq.matcher.is_error():  # it masked every token
                    self._fail_constraint(group, seq.matcher.get_error())
                else:
                    self._fail_group(group, result.errors[seq.seq_id])
                continue
            if seq.index == 0 and seq.is_prefill_done:
                self.scheduler.release_followers(group)
            if seq.seq_id not in result.sampled:
                if s.needs_sample is False and seq.is_prefill_done and group.max_output_tokens == 0:
                    # Scoring only (echo with no tokens to generate): done once the prompt is.
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
                continue
            if s.draft_token_ids and self._append_accepted(s, result, now, stats):
                continue  # a stop among the accepted tokens: nothing after it is emitted
            self._append_token(
                seq, result.sampled[seq.seq_id], result.logprobs.get(seq.seq_id), now, stats
            )
        for group in touched.values():
            if group.finished:
                stats.finished.append(self._finished_stats(group, now))
        return list(touched.values())

    def _append_accepted(
        self, s: ScheduledSeq, result: RunnerOutput, now: float, stats: StepStats
    ) -> bool:
        """Append a verified sequence's accepted draft tokens, counting the verification; True
        when one of them ended the sequence."""
        seq = s.seq
        accepted = result.num_accepted.get(seq.seq_id, 0)
        proposed = len(s.draft_token_ids)
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
            self._append_token(seq, s.draft_token_ids[j], lp, now, stats)
            if seq.status.finished:
                return True
        return False

    @staticmethod
    def _store_prompt_logprobs(seq: Sequence, first: int, rows: list[TokenLogprob]) -> None:
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

    def _append_token(
        self, seq: Sequence, token_id: int, logprob, now: float, stats: StepStats
    ) -> None:
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

        status = None
        matcher = seq.matcher
        if matcher is not None and (
            matcher.is_error() or (not matcher.is_stopped() and not matcher.consume_token(token_id))
        ):
            # The mask allowed only grammar tokens, so the matcher gave up (a limit of llguidance's,
            # such as a regex that builds too many states): this request alone fails, blamed on it.
            self._fail_constraint(group, matcher.get_error())
            return
        if token_id in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token_id
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        else:
            assert seq.detokenizer is not None
            try:
                stop = seq.detokenizer.add_tokens([token_id])
            except Exception as e:  # a detokenizer fault fails this request only
                logger.exception("detokenizer failed for %s", seq.seq_id)
                self._fail_group(group, f"detokenization failed: {e}")
                return
            if stop is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        if status is None and matcher is not None and matcher.is_stopped():
            status = SequenceStatus.FINISHED_STOPPED  # the constraint is complete
        if status is None and (
            seq.num_output_tokens >= group.max_output_tokens or seq.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(seq, status)

    def _fail_group(
        self, group: RequestGroup, message: str, fault: InvalidRequestError | None = None
    ) -> None:
        group.error, group.fault = message, fault
        for seq in group.seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)

    def _fail_constraint(self, group: RequestGroup, why: str) -> None:
        constraint = group.requested.structured_outputs
        source = constraint.source if constraint is not None else "structured_outputs"
        why = why.strip().splitlines()[0] if why.strip() else "unknown error"
        fault = ConstraintError(why, source)
        self._fail_group(group, str(fault), fault)

    def _finished_stats(self, group: RequestGroup, now: float) -> FinishedRequestStats:
        m = group.metrics
        m.finished_time = now
        reason = "error" if group.error else group.seqs[0].status.value
        return FinishedRequestStats(
            group.request_id,
            reason,
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

    # -- outputs ---------------------------------------------------------------------------------
    def make_output(self, group: RequestGroup) -> RequestOutput | None:
        user_params = group.requested
        kind = user_params.output_kind
        finished = group.finished
        if group.error is not None:
            return RequestOutput(
                group.request_id,
                group.prompt,
                group.prompt_token_ids,
                [],
                True,
                num_cached_tokens=group.num_cached_tokens,
                metrics=group.metrics,
                error=group.error,
                fault=group.fault,
            )
        if group.kind == "score":
            return self._score_output(group) if finished else None
        best_of = user_params.num_samples > user_params.n
        if (kind == "final" or best_of) and not finished:
            return None
        delta = kind == "delta" and not best_of
        seqs = group.seqs
        if best_of:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: user_params.n]
        completions = []
        for choice_index, seq in enumerate(seqs):
            c = self._completion(seq, choice_index, delta, user_params.logprobs is not None)
            if c is not None:
                completions.append(c)
        prompt_logprobs = None
        if group.prompt_logprobs is not None and group.seqs[0].is_prefill_done:
            if not (delta and group.prompt_logprobs_emitted):
                prompt_logprobs = group.prompt_logprobs
                group.prompt_logprobs_emitted = True
        if delta and not completions and not finished and prompt_logprobs is None:
            return None
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            completions,
            finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=group.num_cached_tokens,
            metrics=group.metrics,
            lora=group.lora_name,
        )

    @staticmethod
    def _score_output(group: RequestGroup) -> RequestOutput:
        """One CompletionOutput per choice: its tokens and their logprobs given the context (text is
        left to the caller, which knows how the choice was given)."""
        choices = [
            CompletionOutput(
                index=seq.index,
                text="",
                token_ids=seq.token_ids[seq.score_start :],
                logprobs=list(seq.logprobs),
                finish_reason=seq.status.finish_reason,
                cumulative_logprob=seq.cumulative_logprob,
            )
            for seq in group.seqs
        ]
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            choices,
            True,
            num_cached_tokens=group.num_cached_tokens,
            metrics=group.metrics,
            lora=group.lora_name,
        )

    def _completion(
        self, seq: Sequence, index: int, delta: bool, want_logprobs: bool
    ) -> CompletionOutput | None:
        finished = seq.status.finished
        detok = seq.detokenizer
        assert detok is not None
        if delta and seq.final_emitted:
            return None  # a finished sample of a still-running group: its end was already sent
        start = seq.num_emitted_tokens if delta else 0
        if delta and start >= seq.num_output_tokens and not finished:
            return None
        reasoning: str | None = None
        if delta:
            text = detok.take_delta(finished)
            if detok.reasoning is not None:
                reasoning = detok.take_reasoning_delta(finished)
            if not text and not reasoning and not finished and not want_logprobs:
                return None  # e.g. half of a multi-byte character: wait for visible text
        elif finished:
            detok.take_delta(finished=True)  # flush held text, as streaming does, so both agree
            text = detok.answer_text
            reasoning = detok.visible_reasoning(finished=True)
        else:
            text = detok.visible_text()
            reasoning = detok.visible_reasoning()
        token_ids = seq.token_ids[seq.num_prompt_tokens + start :]  # the new ones only, not all
        logprobs = seq.logprobs[start:] if want_logprobs else None
        seq.num_emitted_tokens = seq.num_output_tokens
        seq.final_emitted = finished
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob,
            num_output_tokens=seq.num_output_tokens,
            reasoning=reasoning,
            num_reasoning_tokens=detok.num_reasoning_tokens,
        )
