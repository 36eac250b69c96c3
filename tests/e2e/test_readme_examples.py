"""Every README block marked `<!-- example -->` runs as written against a live server."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO_ROOT, ServerProcess

README = (REPO_ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"<!-- example -->\s*```(bash|python)\n(.*?)```", README, re.DOTALL)


@pytest.mark.parametrize(
    ("lang", "code"), EXAMPLES, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(EXAMPLES)]
)
def test_readme_example_runs(tiny_server: ServerProcess, lang: str, code: str) -> None:
    code = code.replace("http://localhost:8000", tiny_server.url)
    cmd = (
        ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    )
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr + result.stdout
    assert '"error"' not in result.stdout, result.stdout
    assert result.stdout.strip()
