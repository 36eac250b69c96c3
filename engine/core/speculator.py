"""Which sequences speculate and with which draft tokens (no torch): the scheduler asks for drafts per
decoding sequence and reports how many the verification accepted. Steps aside under load
(`disable_by_batch_size`) and per sequence by its acceptance: the draft length is cut to the
positions likely enough to be accepted to pay for their verification, and a sequence whose drafts do
not pay at all pauses, then retries later (pauses doubling)."""

from __future__ import annotations

import math
import weakref
from typing import Any, Protocol

from engine.core.ngram_proposer import NgramIndex
from engine.core.request import Sequence
from engine.core.spec_config import DRAFT_METHODS, SpeculativeConfig
from engine.core.suffix_proposer import SequenceSuffix, SuffixCache

DECAY = 0.7  # weight kept by a sequence's older verifications in its acceptance estimate
# A step costs about (STEP_OVERHEAD_ROWS + decode rows + DRAFT_ROW_COST x draft rows) x the time
# of one row: on CPU at batch 1 an extra row adds about 0.25-0.3 of a decode step, and a verified
# draft row costs more than a decode row (benchmarks/spec_decode.py at concurrency 32: drafts with
# 81% acceptance cost a third of the throughput). An accepted draft saves its sequence one row and
# its share of a step's fixed cost; a rejected one wastes its row. So draft position j pays while
# the chance of reaching and accepting it exceeds DRAFT_ROW_COST / (1 + STEP_OVERHEAD_ROWS / batch):
# about 0.31 for one sequence, 0.9 for 8, and never from 12 on (not even a probe).
STEP_OVERHEAD_ROWS = 3.0
DRAFT_ROW_COST = 1.25
FIRST_PAUSE = 8  # decode tokens of the first pause when no draft pays off; each pause doubles
MAX_PAUSE = 256


def grammar_cut(matcher: Any, drafts: list[int]) -> list[int]:
    """The drafts before the first one the grammar rejects (checked without consuming)."""
    return drafts[: matcher.validate_tokens(drafts)]


class _SeqState:
    __slots__ = ("index", "accepted", "rejected", "pause", "resume_at", "probe")

    def __init__(self, index: NgramIndex | SequenceSuffix | None) -> None:
        self.index = index
        # Decayed counts of accepted drafts and of rejections (a verification stopping early):
        # accepted / (accepted + rejected) estimates the chance a draft token is accepted.
        self.accepted, self.rejected = 2.0, 0.5  # optimistic start (0.8)
        self.pause = FIRST_PAUSE
        self.resume_at = 0  # no proposals before the sequence has this many tokens
        self.probe = False  # after a pause: one draft at least, to measure acceptance again

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def draft_length(self, limit: int, threshold: float) -> int:
        """Drafts worth verifying: position j pays while acceptance ** j > threshold."""
        alpha = self.acceptance
        if alpha >= 1.0:
            return limit
        length = 0 if alpha <= threshold else int(math.log(threshold) / math.log(alpha))
        if self.probe:
            self.probe = False
            length = max(length, 1)
        return min(limit, length)


class Drafter(Protocol):
    """A model that proposes (engine.executor.draft_model): greedy drafts for many sequences in
    batched forwards over its own paged KV, which it frees with the target's sequence."""

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to n drafts per (sequence, n), by seq_id (a sequence may get none)."""
        ...

    def release(self, seq: Sequence) -> None:
        """Free the draft KV of `seq` (finished or preempted); idempotent."""
        ...


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, drafter: Drafter | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter  # draft_model / layer_skip
        assert (drafter is not None) == (config.method in DRAFT_METHODS)
        self._pending: dict[str, list[int]] = {}  # the drafter's proposals for this step
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()
        self.suffix_cache: SuffixCache | None = None
        if config.method == "suffix":
            self.suffix_cache = SuffixCache(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )

    def enabled_for_batch(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def begin_step(self, running: list[Sequence]) -> None:
        """A drafter proposes for every decoding sequence at once, before the step is scheduled
        (propose then hands each its drafts, cut to the budget left)."""
        self._pending = {}
        if self.drafter is None:
            return
        wants = []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                length = self._length(seq, self.config.num_speculative_tokens, len(running))
                if length:
                    wants.append((seq, length))
        if wants:
            self._pending = self.drafter.propose(wants)

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)

    def propose(self, seq: Sequence, budget: int, batch_size: int = 1) -> list[int]:
        """Draft tokens for `seq`'s next verification step: at most `budget`, never past its
        max_tokens or the model length (their bonus token included); as many as pay off among
        `batch_size` running sequences. With structured outputs the proposal is cut where the
        grammar would reject it (checked without consuming)."""
        if self.drafter is not None:
            drafts = self._pending.pop(seq.seq_id, [])[: self._room(seq, budget)]
        else:
            length = self._length(seq, budget, batch_size)
            if length == 0:
                return []
            index = self._state(seq).index
            if isinstance(index, SequenceSuffix):
                assert self.suffix_cache is not None
                drafts = index.propose(self.suffix_cache, seq.seq_id, seq.token_ids, length)
            else:
                assert index is not None
                drafts = index.propose(seq.token_ids, length)
        if drafts and seq.matcher is not None:
            drafts = grammar_cut(seq.matcher, drafts)
        return drafts

    def _room(self, seq: Sequence, budget: int) -> int:
        matcher = seq.matcher
        if seq.group.max_output_tokens <= 0 or (
            matcher is not None and (matcher.is_error() or matcher.is_stopped())
        ):
            return 0
        return min(
            budget,
            self.config.num_speculative_tokens,
            seq.group.max_output_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )

    def _length(self, seq: Sequence, budget: int, batch_size: int) -> int:
        """How many drafts to ask for (0: none; a sequence whose drafts do not pay pauses)."""
        room = self._room(seq, budget)
        if room <= 0:
            return 0
        state = self._state(seq)
        if seq.num_tokens < state.resume_at:
            return 0
        threshold = DRAFT_ROW_COST / (1.0 + STEP_OVERHEAD_ROWS / max(1, batch_size))
        if threshold >= 1.0:
            return 0  # no draft pays at this batch size: no probes either, the estimate is kept
        length = state.draft_length(room, threshold)
        if length == 0:  # not paying off: decode plainly for a while, then probe again
            state.resume_at = seq.num_tokens + state.pause
            state.pause = min(2 * state.pause, MAX_PAUSE)
            state.probe = True  # the estimate is kept: probes that succeed raise it again
        return length

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verification of `num_proposed` drafts accepted the first `num_accepted`."""
        state = self._state(seq)
        state.accepted = DECAY * state.accepted + num_accepted
        state.rejected = DECAY * state.rejected + (num_accepted < num_proposed)
        if num_accepted:
            state.pause = FIRST_PAUSE

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._states.get(seq)
        if state is None:
            c = self.config
            index: NgramIndex | SequenceSuffix | None = None
            if c.method == "suffix":
                index = SequenceSuffix(c.suffix_decoding_max_tree_depth, seq.num_prompt_tokens)
            elif c.method == "ngram":
                index = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            state = self._states[seq] = _SeqState(index)
        return state
