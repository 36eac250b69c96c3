"""Turns request progress into RequestOutputs: final, delta or cumulative, with best_of ranking (the
detokenized text and reasoning taken from each sample's detokenizer); a score request's choices with
their token logprobs. The tokens themselves were appended by the scheduler (update_from_output)."""

from __future__ import annotations

from engine.core.outputs import CompletionOutput, RequestOutput
from engine.core.request import RequestGroup, Sequence


class OutputProcessor:
    """Builds a step's RequestOutputs from the request groups the scheduler updated."""

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
