"""The OpenMP workers' wait between parallel regions, set before torch loads libgomp (torch-free)."""

from __future__ import annotations

import os
import sys

# libgomp's workers wait for the next parallel region spinning, by default ~300k times (milliseconds),
# holding their core while the step's Python, the event loop or a neighbouring process needs it;
# on a shared machine a descheduled worker then stalls every barrier of the step. A short spin
# covers the gaps between the regions of one step, then the worker sleeps. Measured with
# benchmarks/neighbours.py (README, "Threads that share the machine").
GOMP_SPINCOUNT = "1000"


def set_openmp_wait_policy() -> str:
    """Set the OpenMP workers' wait (before torch loads libgomp) unless the user chose one; return
    a line for the log. The server calls it at start-up, benchmarks before they import torch."""
    chosen = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    if chosen:
        return "OpenMP wait: " + " ".join(f"{k}={v}" for k, v in chosen.items()) + " (environment)"
    if "torch" in sys.modules:
        return "OpenMP wait: libgomp's default (torch was loaded before kvserve could set it)"
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    return f"OpenMP wait: GOMP_SPINCOUNT={GOMP_SPINCOUNT} (a short spin, then sleep)"
