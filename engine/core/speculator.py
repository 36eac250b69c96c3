"""Which sequences speculate and with which draft tokens (no torch): the scheduler asks for drafts per
decoding sequence and reports how many the verification accepted. Steps aside under load
(`disable_by_batch_size`) and per sequence by what its proposals earn: each sequence keeps decayed
per-position acceptance estimates (over the speculator's own across recent sequences), and its
draft length is the one whose expected accepted tokens pay best for what it costs (verified rows
and draft forwards, engine.core.spec_cost); when none pays, the sequence decodes plainly for a
while, then probes with one draft (pauses doubling, and never shorter than what keeps failed
probes near PROBE_SHARE of the decode time). A new sequence probes before it pauses, from the first
pause: what other prompts earned says little about this one's (a copy-heavy prompt after random
ones must not wait out their long pauses)."""

from __future__ import annotations

import math
import time
import weakref
from typing import Any, Protocol

from engine.core.ngram_proposer import NgramIndex
from engine.core.request import Sequence
from engine.core.spec_config import DRAFT_METHODS, SpeculativeConfig
from engine.core.spec_cost import MeasuredSpecCost, PriorSpecCost, SpecCost
from engine.core.suffix_proposer import SequenceSuffix, SuffixCache

DECAY = 0.7  # weight kept by a sequence's older verifications in its acceptance estimates
SHARED_DECAY = 0.95  # the same for the speculator's estimates over all sequences
SHARED_WEIGHT = 2.0  # verifications' worth of the shared estimate in a sequence's own
PRIOR = 0.8  # the acceptance assumed before anything was verified (optimistic: it is measured)
MIN_GAIN = 1.03  # speculate when the expected tokens per unit of time beat plain decoding by this
FIRST_PAUSE = 8  # decode tokens of the first pause when no draft pays off; each pause doubles
MAX_PAUSE = 256
# A failed probe costs its draft row and forward: a pause lasts at least that price over this
# share of plain decoding, so a drafter that is never right costs about 2% between probes (a draft
# model's forward is a step's worth: ~70 tokens), but at most PROBE_PAUSE_CAP tokens (a cost spoilt
# by a busy machine must not switch speculation off for long).
PROBE_SHARE = 0.02
PROBE_PAUSE_CAP = 64


def grammar_cut(matcher: Any, drafts: list[int]) -> list[int]:
    """The drafts before the first one the grammar rejects (checked without consuming)."""
    return drafts[: matcher.validate_tokens(drafts)]


class Acceptance:
    """Decayed counts, per draft position j, of verifications that reached j (every draft before
    it accepted) and of those that accepted it: their ratio estimates the chance that draft j is
    accepted once j - 1 was, so runs that copy the prompt (a miss at the first position, then
    long runs) are told apart from scattered misses."""

    __slots__ = ("reached", "accepted")

    def __init__(self, size: int) -> None:
        self.reached = [0.0] * size
        self.accepted = [0.0] * size

    def record(self, num_proposed: int, num_accepted: int, decay: float) -> None:
        reached, accepted = self.reached, self.accepted
        for j in range(len(reached)):
            reached[j] *= decay
            accepted[j] *= decay
        for j in range(min(num_proposed, num_accepted + 1, len(reached))):
            reached[j] += 1.0
            accepted[j] += j < num_accepted

    def rates(self, prior: list[float], weight: float) -> list[float]:
        """Per position: the chance of acceptance, `prior` counting as `weight` verifications."""
        return [
            (a + weight * p) / (r + weight)
            for a, r, p in zip(self.accepted, self.reached, prior, strict=True)
        ]


def best_length(
    rates: list[float], limit: int, batch_size: int, cost: SpecCost
) -> tuple[int, float]:
    """The draft length (at most `limit`) that maximises the expected tokens per unit of time
    against plain decoding, and that ratio: a step of `batch_size` sequences emits batch_size
    tokens plus this sequence's expected accepted drafts (sum over j of the chance of accepting
    drafts 1..j), and takes 1 + the cost of the drafts' rows and forwards (in plain steps)."""
    best, best_gain = 0, 1.0
    reach, expected = 1.0, 0.0
    for length in range(1, min(limit, len(rates)) + 1):
        reach *= rates[length - 1]
        expected += reach
        price = cost.verify_cost(batch_size, length) + cost.draft_cost(batch_size, length)
        gain = (1.0 + expected / batch_size) / (1.0 + price)
        if gain > best_gain:
            best, best_gain = length, gain
    return best, best_gain


class _SeqState:
    __slots__ = ("index", "acceptance", "pause", "resume_at", "probe")

    def __init__(self, index: NgramIndex | SequenceSuffix | None, size: int) -> None:
        self.index = index
        self.acceptance = Acceptance(size)
        self.pause = FIRST_PAUSE
        self.resume_at = 0  # no proposals before the sequence has this many tokens
        # New, or after a pause: one draft at least, to measure this sequence's acceptance.
        self.probe = True


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
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        drafter: Drafter | None = None,
        cost: SpecCost | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter  # draft_model / layer_skip
        assert (drafter is not None) == (config.method in DRAFT_METHODS)
        # What proposals cost; the measured model learns from observe_step unless one is given.
        measured = MeasuredSpecCost(drafter is not None)
        self.measured = measured if cost is None else None
        self.cost: SpecCost = measured if cost is None else cost
        self.load_model = PriorSpecCost()
        self._pending: dict[str, list[int]] = {}  # the drafter's proposals for this step
        self._draft_seconds, self._draft_forwards = 0.0, 0  # the drafter's work this step
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()
        self.size = config.num_speculative_tokens
        self.shared = Acceptance(self.size)  # over all sequences: the prior of new ones
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
        self._draft_seconds, self._draft_forwards = 0.0, 0
        if self.drafter is None:
            return
        wants = []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                length = self._length(seq, self.config.num_speculative_tokens, len(running))
                if length:
                    wants.append((seq, length))
        if wants:
            start = time.perf_counter()
            self._pending = self.drafter.propose(wants)
            self._draft_seconds = time.perf_counter() - start
            self._draft_forwards = max(n for _, n in wants)

    def observe_step(
        self, batch_size: int, num_drafts: int, has_prefill: bool, seconds: float
    ) -> None:
        """The engine's step of `batch_size` decoding (or verified) sequences took `seconds`: the
        measured cost model learns from steps without prefill chunks."""
        if self.measured is not None and not has_prefill:
            self.measured.observe(
                batch_size, num_drafts, seconds, self._draft_seconds, self._draft_forwards
            )

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
        # The load switch, on the row model's constants (a noisy measurement must not turn
        # speculation off for good: probes measure again): when not even certain drafts would
        # pay at this batch size, no drafts and no probes; the estimates are kept.
        if best_length([1.0] * room, room, batch_size, self.load_model)[1] < MIN_GAIN:
            return 0
        prior = self.shared.rates([PRIOR] * self.size, 1.0)
        rates = state.acceptance.rates(prior, SHARED_WEIGHT)
        length, gain = best_length(rates, room, batch_size, self.cost)
        if state.probe:
            state.probe = False
            return max(length, 1) if gain < MIN_GAIN else length
        if gain < MIN_GAIN:  # not paying off: decode plainly for a while, then probe again
            state.resume_at = seq.num_tokens + max(state.pause, self._probe_pause(batch_size))
            state.pause = min(2 * state.pause, MAX_PAUSE)
            state.probe = True  # the estimates are kept: probes that succeed raise them again
            return 0
        return length

    def _probe_pause(self, batch_size: int) -> int:
        """The shortest pause after a failed probe: its price (one verified draft row and, for a
        drafter, one draft forward, in plain steps) over PROBE_SHARE, at most PROBE_PAUSE_CAP."""
        price = self.cost.verify_cost(batch_size, 1) + self.cost.draft_cost(batch_size, 1)
        return min(PROBE_PAUSE_CAP, math.ceil(price / PROBE_SHARE))

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verification of `num_proposed` drafts accepted the first `num_accepted`."""
        state = self._state(seq)
        state.acceptance.record(num_proposed, num_accepted, DECAY)
        self.shared.record(num_proposed, num_accepted, SHARED_DECAY)
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
            state = self._states[seq] = _SeqState(index, self.size)
        return state
