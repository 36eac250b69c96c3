"""Fault injection for reliability tests: inert unless the hidden environment variable
KVSERVE_FAULT_INJECTION=1 is set at construction, which then installs the hooks below (a model runner
subclass, an add-request hook); a completion whose prompt text starts with a marker misbehaves.
Nothing here is consulted on the normal path: with the variable unset no hook exists."""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.core.pending import AddRequest
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler import ScheduledSeq
from engine.executor.model_runner import ModelRunner
from engine.executor.sampler import SamplingRow

logger = logging.getLogger(__name__)

FAULT_INJECTION_ENV = "KVSERVE_FAULT_INJECTION"  # deliberately not a CLI flag: never in --help
NAN_LOGITS = "KVSERVE_FAULT:nan"  # the model runner gives this request's rows NaN logits ...
NAN_AFTER_TOKENS = 2  # ... once it has this many output tokens, so a stream fails mid-way
ENGINE_DEATH = "KVSERVE_FAULT:die"  # the engine loop raises while adding this request
SLOW_STEPS = "KVSERVE_FAULT:slow"  # every step that samples for this request takes ...
SLOW_STEP_SECONDS = 0.02  # ... this much longer: a test acts while its stream surely runs


def fault_injection_enabled() -> bool:
    enabled = os.environ.get(FAULT_INJECTION_ENV) == "1"
    if enabled:
        logger.warning(
            "%s=1: fault injection is on; never use this in production", FAULT_INJECTION_ENV
        )
    return enabled


def wants_fault(prompt: str | None, marker: str) -> bool:
    """Only text prompts carry markers: the runner sees token ids, the engine keeps the text."""
    return prompt is not None and prompt.startswith(marker)


class FaultInjectingRunner(ModelRunner):
    """A ModelRunner whose NAN_LOGITS requests get NaN logits after NAN_AFTER_TOKENS tokens, which
    exercises the sampler's per-row non-finite check (the request fails, its batch-mates do not),
    and whose steps with a SLOW_STEPS request take SLOW_STEP_SECONDS longer (however fast the
    machine, such a stream is still running a while after it starts)."""

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        seqs: list[ScheduledSeq],
        out: RunnerOutput,
    ) -> None:
        bad = [
            i
            for i, s in enumerate(seqs)
            if wants_fault(s.seq.group.prompt, NAN_LOGITS)
            and s.seq.num_output_tokens >= NAN_AFTER_TOKENS
        ]
        if bad:
            logits[bad] = float("nan")
        if any(wants_fault(s.seq.group.prompt, SLOW_STEPS) for s in seqs):
            time.sleep(SLOW_STEP_SECONDS)
        super()._sample(logits, rows, seqs, out)


class EngineDeathFault:
    """An add-request hook: adding an ENGINE_DEATH request raises inside the engine loop, which then
    dies (every waiter fails, /health turns 503)."""

    def __call__(self, request: AddRequest) -> None:
        if wants_fault(request.prompt, ENGINE_DEATH):
            raise RuntimeError("injected engine failure (KVSERVE_FAULT_INJECTION)")
