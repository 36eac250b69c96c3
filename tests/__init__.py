"""kvserve's tests; `repo_pythonpath` is for the ones that start a child Python."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def repo_pythonpath() -> str:
    """PYTHONPATH for a child process: the repository first, then whatever the parent's already held
    (the GPU check installs kvserve's packages into a folder it adds there)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(REPO_ROOT), *rest])
