"""The per-step token budget on CPU, from the measured cost of steps (no torch).

A fixed budget (`max_num_batched_tokens`, 2048) lets one step carry a 2048-token prefill chunk, which
on a small CPU takes seconds: every stream decoding beside it waits that long for its next token.
Here the engine's own step durations are split into two measured parts:

- the decode part: an exponentially weighted average of the steps that only decode;
- the prefill part, what a step took beyond that, fitted as

      c_token * prefill_tokens + c_pair * attention_pairs

  (attention_pairs: the query-key pairs the step's chunks attend, a chunk of n tokens after p cached
  ones reading n * (p + (n + 1) / 2)) by least squares over recent prefill steps, older steps
  weighing less (the machine and the load drift), both coefficients kept >= 0.

Before a step, while streams decode, the budget is the largest prefill chunk whose predicted step
fits the target step time (`target_step_ms`), so other users' tokens keep coming about once per
target; with nothing decoding, no one waits, and prefill takes the full `max_num_batched_tokens`.
Prefill always gets at least MIN_PREFILL_SHARE of the target and at least as long as the decodes
take (on a machine too busy for the target, streams slow down to twice a decode step rather than
long prompts crawling). The chunk starts at WARMUP_TOKENS and grows to at most twice the largest one
measured: the fit is never trusted far beyond what it has seen."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

WARMUP_TOKENS = 64  # the prefill chunk beside decodes before the fit has seen prefill steps
MIN_PREFILL_TOKENS = 16  # a long prompt always moves at least this far per step
MIN_PREFILL_SHARE = 0.25  # of the target step time, the least prefill gets
# target_step_ms=None (auto) on CPU under block weights: see README, Long prompts on CPU (mixed load)
AUTO_TARGET_STEP_MS = 200.0
CALIBRATION_STEPS = 2  # prefill steps measured before the fit's predictions are used
DECAY = 0.85  # per observed step: the weight of what came before (half-life about 4 steps)


def resolve_target_step_ms(requested: float | None, on_cpu: bool, block_weights: bool) -> float:
    """The step-time target in force: `requested`, or for None (auto) AUTO_TARGET_STEP_MS on CPU
    under block-quantized weights (their outputs do not change with where a prompt's chunks end,
    which the budget moves with measured times), else 0 (the fixed budget). GPUs: always 0."""
    if not on_cpu:
        return 0.0
    if requested is None:
        return AUTO_TARGET_STEP_MS if block_weights else 0.0
    return requested


@dataclass(frozen=True)
class StepLoad:
    """What one step carries, as the cost model sees it."""

    num_decodes: int = 0
    num_prefill_tokens: int = 0  # prefill chunks (and verified speculative drafts)
    attention_pairs: float = 0.0  # sum over chunks of n * (start + (n + 1) / 2)

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> StepLoad:
        """From (num_new_tokens, start_pos) per scheduled sequence; 1 new token is a decode."""
        decodes = tokens = 0
        pairs = 0.0
        for n, start in chunks:
            if n == 1:
                decodes += 1
            else:
                tokens += n
                pairs += chunk_pairs(n, start)
        return cls(decodes, tokens, pairs)


def chunk_pairs(n: int, start: int) -> float:
    """Query-key pairs of a causal chunk of n tokens after `start` cached ones."""
    return n * (start + (n + 1) / 2)


class StepBudget:
    """Fits step durations and turns a target step time into a token budget (see the module doc)."""

    def __init__(self, target_step_s: float, max_tokens: int) -> None:
        if target_step_s <= 0:
            raise ValueError(f"the target step time must be positive, got {target_step_s}")
        self.target_s = target_step_s
        self.max_tokens = max_tokens
        self.decode_s: float | None = None  # the decode part of a step (None: no decode step yet)
        # Decayed sums of the prefill fit's normal equations, in units of 1k tokens and 1M pairs.
        self._snn = self._snp = self._spp = self._sny = self._spy = 0.0
        self.c_token = self.c_pair = 0.0  # seconds per prefill token, per attention pair
        self.num_prefill_steps = 0  # prefill steps observed
        self.largest_chunk = 0  # the most prefill tokens of one observed step
        self.last_budget = max_tokens

    # -- fitting -------------------------------------------------------------------------------
    def observe(self, load: StepLoad, seconds: float) -> None:
        """One step's measured duration."""
        if not load.num_prefill_tokens:
            if load.num_decodes:
                prev = self.decode_s
                self.decode_s = seconds if prev is None else DECAY * prev + (1 - DECAY) * seconds
            return
        base = (self.decode_s or 0.0) if load.num_decodes else 0.0
        y = max(0.0, seconds - base)
        n, p = load.num_prefill_tokens / 1e3, load.attention_pairs / 1e6
        d = DECAY
        self._snn, self._snp, self._spp = (
            d * self._snn + n * n,
            d * self._snp + n * p,
            d * self._spp + p * p,
        )
        self._sny, self._spy = d * self._sny + n * y, d * self._spy + p * y
        self._fit()
        self.num_prefill_steps += 1
        self.largest_chunk = max(self.largest_chunk, load.num_prefill_tokens)

    def _fit(self) -> None:
        """Non-negative least squares in two unknowns: the joint solution if both are >= 0, else
        the better of the two one-coefficient fits."""
        det = self._snn * self._spp - self._snp * self._snp
        if det > 1e-12 * max(1e-30, self._snn * self._spp):
            a = (self._sny * self._spp - self._spy * self._snp) / det
            b = (self._spy * self._snn - self._sny * self._snp) / det
            if a >= 0 and b >= 0:
                self.c_token, self.c_pair = a / 1e3, b / 1e6
                return
        a = self._sny / self._snn if self._snn > 0 else 0.0  # tokens only
        b = self._spy / self._spp if self._spp > 0 else 0.0  # pairs only
        # residual sum of squares of each (up to the common sum of y^2)
        rss_a = -2 * a * self._sny + a * a * self._snn
        rss_b = -2 * b * self._spy + b * b * self._spp
        if rss_a <= rss_b:
            self.c_token, self.c_pair = max(0.0, a) / 1e3, 0.0
        else:
            self.c_token, self.c_pair = 0.0, max(0.0, b) / 1e6

    def predict(self, load: StepLoad) -> float:
        """Predicted seconds of a step."""
        decode = (self.decode_s or 0.0) if load.num_decodes else 0.0
        return decode + self.c_token * load.num_prefill_tokens + self.c_pair * load.attention_pairs

    @property
    def calibrated(self) -> bool:
        return self.num_prefill_steps >= CALIBRATION_STEPS

    # -- the budget ----------------------------------------------------------------------------
    def prefill_tokens(self, num_decodes: int, prefill_start: int) -> int:
        """Prefill tokens the next step may carry beside `num_decodes` decodes, its first chunk
        starting after `prefill_start` computed tokens."""
        room = self.max_tokens - num_decodes
        if num_decodes == 0 or room <= MIN_PREFILL_TOKENS:
            return max(0, room)  # nobody waits on this step (or no room to share)
        trusted = 2 * self.largest_chunk if self.largest_chunk else WARMUP_TOKENS
        if not self.calibrated:
            return max(MIN_PREFILL_TOKENS, min(room, WARMUP_TOKENS, trusted))
        decode = self.decode_s or 0.0
        spare = max(self.target_s - decode, MIN_PREFILL_SHARE * self.target_s, decode)
        # c_pair / 2 n^2 + (c_token + c_pair (start + 1/2)) n <= spare
        a = self.c_pair / 2
        b = self.c_token + self.c_pair * (prefill_start + 0.5)
        if a > 0:
            n = (-b + (b * b + 4 * a * spare) ** 0.5) / (2 * a)
        elif b > 0:
            n = spare / b
        else:
            n = float(room)
        return max(MIN_PREFILL_TOKENS, min(room, int(n), trusted))

    def token_budget(self, num_decodes: int, prefill_start: int) -> int:
        """The whole step's budget: the decodes plus prefill_tokens()."""
        self.last_budget = num_decodes + self.prefill_tokens(num_decodes, prefill_start)
        return self.last_budget
