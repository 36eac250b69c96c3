"""More torch threads than the CPUs the process may run on: one clear warning at start-up."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.core.config import ModelConfig
from engine.executor.model_runner import prepare_model


@pytest.mark.parametrize("extra", [0, 1])
def test_more_threads_than_cpus_warn_once(caplog: pytest.LogCaptureFixture, extra: int) -> None:
    cpus = len(os.sched_getaffinity(0))
    saved = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.executor.model_runner"):
            prepare_model(torch.nn.Linear(2, 2), ModelConfig(num_threads=cpus + extra))
    finally:
        torch.set_num_threads(saved)
    warnings = [r.getMessage() for r in caplog.records if "threads on the" in r.getMessage()]
    assert len(warnings) == extra
    if extra:
        assert f"{cpus + 1} threads on the {cpus} CPU(s)" in warnings[0]
        assert f"use --threads {cpus}" in warnings[0]
