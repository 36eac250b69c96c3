"""scripts/build-llama-cpp.sh (benchmark-only: never builds in the tests) refuses an unknown MAX_ISA
before it downloads, extracts or creates anything."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-llama-cpp.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_unknown_max_isa_fails_fast_and_touches_nothing(tmp_path):
    dest = tmp_path / "llama"
    env = {**os.environ, "MAX_ISA": "avx512"}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(dest)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "MAX_ISA: only avx2 is known, not 'avx512'" in done.stderr
    assert not dest.exists()
