"""What a speculative proposal costs (no torch), in units of a plain decode step at the same batch
size: its verified draft rows and, for draft models, the draft forwards that produced it. Modelled
before anything is measured, then measured from the engine's own step durations (recent medians,
so one step slowed by another process does not swing the estimate).

A step's time is modelled as (STEP_OVERHEAD_ROWS + decode rows + row cost x draft rows) x the time
of one row: on CPU at batch 1 a decode step is about four rows' worth (reading the weights once per
step dominates), so a draft row costs about a quarter of a step there; with 32 running sequences it
costs nearly a whole row of a 35-row step. A draft forward (draft_model, layer_skip) costs its
measured seconds over a plain step's."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Protocol

STEP_OVERHEAD_ROWS = 3.0  # a step's fixed cost (weights read once), in decode rows
DRAFT_ROW_COST = 1.25  # a verified draft row, in decode rows (prior; measured at concurrency 32)
DRAFT_FORWARD_COST = 0.5  # a draft forward, in plain steps (prior until one is measured)
WINDOW = 15  # recent samples each median is taken over
MAX_BATCH_KEY = 64  # plain step times are kept per batch size up to this


class SpecCost(Protocol):
    """The cost side of the speculator's rule (a fake one in tests)."""

    def verify_cost(self, batch_size: int, num_drafts: int) -> float:
        """Extra time of verifying `num_drafts` draft rows in a step of `batch_size` sequences,
        in plain steps of that batch."""
        ...

    def draft_cost(self, batch_size: int, num_forwards: int) -> float:
        """Time of `num_forwards` draft forwards for a step of `batch_size` sequences, in plain
        steps of that batch (0 for proposers without a model)."""
        ...


class _Median:
    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)

    def add(self, value: float) -> None:
        self.samples.append(value)

    def get(self, default: float) -> float:
        return statistics.median(self.samples) if self.samples else default


def prior_verify_cost(batch_size: int, num_drafts: int) -> float:
    """The row model with its prior constants: whether the batch is too large for any draft."""
    return num_drafts * DRAFT_ROW_COST / (STEP_OVERHEAD_ROWS + max(1, batch_size))


class PriorSpecCost:
    """SpecCost of the row model's constants alone, never measured (the load switch)."""

    def verify_cost(self, batch_size: int, num_drafts: int) -> float:
        return prior_verify_cost(batch_size, num_drafts)

    def draft_cost(self, batch_size: int, num_forwards: int) -> float:
        return 0.0


class MeasuredSpecCost:
    """SpecCost from the model above, its constants replaced by medians of what the engine
    measured: plain decode steps per batch size, the extra time of verification steps per draft
    row, and draft forwards (`drafts`: whether proposals come from a model)."""

    def __init__(self, drafts: bool) -> None:
        self.drafts = drafts
        self._plain: dict[int, _Median] = {}  # batch size -> seconds of a decode-only step
        self._row = _Median()  # a verified draft row, in decode rows (over all draft lengths)
        self._forward = _Median()  # a draft forward, in plain steps

    # -- SpecCost ----------------------------------------------------------------------------------
    def verify_cost(self, batch_size: int, num_drafts: int) -> float:
        # Linear in the rows, from the median row over every draft length verified: one-draft
        # probes keep it current when longer drafts are not tried (per-length medians went stale).
        return num_drafts * self.row_cost / (STEP_OVERHEAD_ROWS + max(1, batch_size))

    def draft_cost(self, batch_size: int, num_forwards: int) -> float:
        if not self.drafts:
            return 0.0
        return num_forwards * self._forward.get(DRAFT_FORWARD_COST)

    # -- measurement -------------------------------------------------------------------------------
    def observe(
        self,
        batch_size: int,
        num_drafts: int,
        seconds: float,
        draft_seconds: float = 0.0,
        num_forwards: int = 0,
    ) -> None:
        """A step of `batch_size` decoding sequences (no prefill chunk) that verified `num_drafts`
        draft rows and took `seconds`, `draft_seconds` of them in `num_forwards` draft forwards."""
        if batch_size < 1 or seconds <= 0:
            return
        if num_drafts == 0 and num_forwards == 0:
            if batch_size <= MAX_BATCH_KEY:
                self._plain.setdefault(batch_size, _Median()).add(seconds)
            return
        plain = self.plain_seconds(batch_size)
        if plain is None:
            return
        if num_forwards:
            self._forward.add(draft_seconds / num_forwards / plain)
        if num_drafts:
            extra = max(0.0, seconds - draft_seconds - plain) / plain  # in plain steps
            rows = min(4.0 * num_drafts, extra * (STEP_OVERHEAD_ROWS + batch_size))
            self._row.add(rows / num_drafts)

    def plain_seconds(self, batch_size: int) -> float | None:
        """A plain decode step of `batch_size` (measured, or scaled from the nearest measured
        batch size by the row model); None before any was measured."""
        if not self._plain:
            return None
        nearest = min(self._plain, key=lambda b: (abs(b - batch_size), b))
        seconds = self._plain[nearest].get(0.0)
        return seconds * (STEP_OVERHEAD_ROWS + batch_size) / (STEP_OVERHEAD_ROWS + nearest)

    @property
    def row_cost(self) -> float:
        """A verified draft row, in decode rows (measured median, or the prior)."""
        return self._row.get(DRAFT_ROW_COST)

    @property
    def forward_cost(self) -> float:
        """A draft forward, in plain steps (measured median, or the prior)."""
        return self._forward.get(DRAFT_FORWARD_COST)
