"""Which sequences speculate and with which draft tokens (no torch): the scheduler asks for drafts per
decoding sequence and reports how many the verification accepted. Steps aside under load
(`disable_by_batch_size`) and per sequence while its proposals are not paying off (acceptance-aware
back-off: pause, then retry later)."""

from __future__ import annotations

import weakref

from engine.core.ngram_proposer import NgramIndex
from engine.core.request import Sequence
from engine.core.spec_config import SpeculativeConfig

ACCEPTANCE_DECAY = 0.5  # weight of the older verifications in a sequence's acceptance average
MIN_ACCEPTANCE = 0.25  # below this average acceptance rate a sequence pauses its proposals
FIRST_PAUSE = 8  # decode tokens of the first pause; each further pause doubles it
MAX_PAUSE = 256


class _SeqState:
    __slots__ = ("index", "acceptance", "pause", "resume_at")

    def __init__(self, index: NgramIndex) -> None:
        self.index = index
        self.acceptance = 1.0  # decayed average of accepted / proposed (optimistic start)
        self.pause = FIRST_PAUSE
        self.resume_at = 0  # no proposals before the sequence has this many tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()

    def enabled_for_batch(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for `seq`'s next verification step: at most `budget`, never past its
        max_tokens or the model length (their bonus token included), none for constrained output."""
        if seq.matcher is not None or seq.group.max_output_tokens <= 0:
            return []  # grammar-cut proposals are not built: constrained sequences decode plainly
        room = min(
            budget,
            self.config.num_speculative_tokens,
            seq.group.max_output_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if room <= 0:
            return []
        state = self._state(seq)
        if seq.num_tokens < state.resume_at:
            return []
        return state.index.propose(seq.token_ids, room)

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verification of `num_proposed` drafts accepted the first `num_accepted`."""
        state = self._state(seq)
        rate = num_accepted / num_proposed
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * rate
        if state.acceptance >= MIN_ACCEPTANCE:
            if rate >= MIN_ACCEPTANCE:
                state.pause = FIRST_PAUSE
            return
        # Not paying off: decode plainly for a while, then try again from a neutral average.
        state.resume_at = seq.num_tokens + state.pause
        state.pause = min(2 * state.pause, MAX_PAUSE)
        state.acceptance = 2 * MIN_ACCEPTANCE

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._states.get(seq)
        if state is None:
            c = self.config
            state = self._states[seq] = _SeqState(
                NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            )
        return state
