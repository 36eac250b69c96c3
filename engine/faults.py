"""Fault injection for reliability tests: inert unless the hidden environment variable
KVSERVE_FAULT_INJECTION=1 is set, then a completion whose prompt text starts with a marker misbehaves."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

FAULT_INJECTION_ENV = "KVSERVE_FAULT_INJECTION"  # deliberately not a CLI flag: never in --help
NAN_LOGITS = "KVSERVE_FAULT:nan"  # the model runner gives this request's rows NaN logits ...
NAN_AFTER_TOKENS = 2  # ... once it has this many output tokens, so a stream fails mid-way
ENGINE_DEATH = "KVSERVE_FAULT:die"  # the engine loop raises while adding this request


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
