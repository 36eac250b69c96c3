"""The per-step token budget on CPU, from the measured cost of steps (no torch).

A fixed budget (`max_num_batched_tokens`, 2048) lets one step carry a 2048-token prefill chunk, which
on a small CPU takes seconds: every stream decoding beside it waits that long for its next token.
Here a step's duration is modelled from what it carries,

    seconds = c0 + c_decode * decodes + c_token * prefill_tokens + c_pair * attention_pairs

(attention_pairs: the query-key pairs the step's chunks attend, a chunk of n tokens after p cached
ones reading n * (p + (n + 1) / 2)), fitted to the durations of the engine's own steps by recursive
least squares with forgetting (recent steps weigh most: the machine and the load drift). Before a
step, while streams are decoding, the budget is the largest prefill chunk whose predicted step fits
the target step time (`target_step_ms`), so other users' tokens keep coming about once per target;
with nothing decoding, no one waits, and prefill takes the full `max_num_batched_tokens`.

Until the fit has seen a few prefill steps, or beyond twice the largest chunk it has measured, the
budget stays at what was measured (starting from WARMUP_TOKENS): it grows only as steps confirm it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

WARMUP_TOKENS = 256  # the prefill chunk beside decodes before the fit has seen prefill steps
MIN_PREFILL_TOKENS = 16  # a long prompt always moves at least this far per step
# Prefill always gets at least this share of the target, even when the decodes alone fill it (a
# busy machine, many streams): long prompts slow down there, but never crawl.
MIN_PREFILL_SHARE = 0.25
FORGETTING = 0.97  # per step: a step 23 steps ago weighs half as much as this one
CALIBRATION_STEPS = 3  # prefill steps measured before the fit's predictions are used
MAX_COVARIANCE = 1e8  # stop forgetting past this (long runs of alike steps teach the fit nothing)
# Feature scales: keep the least-squares system well conditioned (each feature near 1).
_SCALES = (1.0, 1 / 16, 1 / 1024, 1 / (1 << 20))


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

    def features(self) -> tuple[float, float, float, float]:
        raw = (1.0, self.num_decodes, self.num_prefill_tokens, self.attention_pairs)
        return (
            raw[0] * _SCALES[0],
            raw[1] * _SCALES[1],
            raw[2] * _SCALES[2],
            raw[3] * _SCALES[3],
        )


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
        size = len(_SCALES)
        self._coef = [0.0] * size
        self._p = [[1e4 if i == j else 0.0 for j in range(size)] for i in range(size)]
        self.num_prefill_steps = 0  # prefill steps observed
        self.largest_chunk = 0  # the most prefill tokens of one observed step (decayed on misses)
        self.last_budget = max_tokens

    # -- fitting -------------------------------------------------------------------------------
    def observe(self, load: StepLoad, seconds: float) -> None:
        """One step's measured duration (recursive least squares, forgetting factor FORGETTING)."""
        x = load.features()
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(len(x))) for i in range(len(x))]
        denom = FORGETTING + sum(x[i] * px[i] for i in range(len(x)))
        gain = [v / denom for v in px]
        err = seconds - sum(c * v for c, v in zip(self._coef, x, strict=True))
        self._coef = [c + g * err for c, g in zip(self._coef, gain, strict=True)]
        forget = FORGETTING if sum(p[i][i] for i in range(len(x))) < MAX_COVARIANCE else 1.0
        self._p = [
            [(p[i][j] - gain[i] * px[j]) / forget for j in range(len(x))] for i in range(len(x))
        ]
        if load.num_prefill_tokens:
            self.num_prefill_steps += 1
            self.largest_chunk = max(self.largest_chunk, load.num_prefill_tokens)
            if seconds > self.target_s * 1.5:  # it overshot: trust smaller chunks again
                self.largest_chunk = max(MIN_PREFILL_TOKENS, load.num_prefill_tokens // 2)

    def predict(self, load: StepLoad) -> float:
        """Predicted seconds of a step (coefficients clamped at 0: no step is cheaper for more)."""
        return sum(max(0.0, c) * v for c, v in zip(self._coef, load.features(), strict=True))

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
        if not self.calibrated:
            return max(MIN_PREFILL_TOKENS, min(room, WARMUP_TOKENS, self._trusted()))
        c0, c_dec, c_tok, c_pair = (
            max(0.0, c) * s for c, s in zip(self._coef, _SCALES, strict=True)
        )
        spare = max(self.target_s - c0 - c_dec * num_decodes, MIN_PREFILL_SHARE * self.target_s)
        # c_pair / 2 n^2 + (c_tok + c_pair (start + 1/2)) n <= spare
        a = c_pair / 2
        b = c_tok + c_pair * (prefill_start + 0.5)
        if a > 0:
            n = (-b + (b * b + 4 * a * spare) ** 0.5) / (2 * a)
        elif b > 0:
            n = spare / b
        else:
            n = float(room)
        return max(MIN_PREFILL_TOKENS, min(room, int(n), self._trusted()))

    def token_budget(self, num_decodes: int, prefill_start: int) -> int:
        """The whole step's budget: the decodes plus prefill_tokens()."""
        self.last_budget = num_decodes + self.prefill_tokens(num_decodes, prefill_start)
        return self.last_budget

    def _trusted(self) -> int:
        """Twice the largest chunk measured (WARMUP_TOKENS before any): the fit is not trusted far
        beyond what it has seen."""
        return 2 * self.largest_chunk if self.largest_chunk else WARMUP_TOKENS
