"""The built wheel installs only `engine` and `server`, and `kvserve bench` runs from it alone.

The wheel is built from a copy of the sources, installed with `--target` into a temporary folder, and
`python -m server bench` is run from there (repository NOT on the path) against a small fake
OpenAI-compatible server in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "engine", "server", "benchmarks")


def _build_isolation_flags() -> list[str]:
    """Build offline with this environment's setuptools when it is new enough (pyproject's floor)."""
    if importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("wheel") is None:
        return []  # pip fetches the build backend into an isolated environment
    import setuptools

    major = int(setuptools.__version__.split(".")[0])
    return ["--no-build-isolation"] if major >= 77 else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)]
    result = subprocess.run(
        [*cmd, *_build_isolation_flags()], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("kvserve-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target)]
        + [str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def test_wheel_holds_only_the_engine_and_server_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {
        name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")
    }
    assert top_level == {"engine", "server"}, sorted(top_level)
    assert "server/bench/driver.py" in names and "server/bench/metrics.py" in names
    assert not any(name.startswith("benchmarks/") for name in names)


def test_wheel_declares_the_load_generator_dependencies(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(meta_name).decode()
    requires = {
        line.split(":", 1)[1]
        .strip()
        .split(";")[0]
        .split(">")[0]
        .split("=")[0]
        .split("[")[0]
        .lower()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    assert {"httpx", "tqdm", "tokenizers"} <= requires, sorted(requires)


class _FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/models and streamed /v1/completions: three one-token chunks, then usage, then [DONE]."""

    bodies: list[dict] = []

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self.send_error(404)
            return
        self._send(200, "application/json", json.dumps({"data": [{"id": "fake-model"}]}))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        usage = {"prompt_tokens": 4, "completion_tokens": body["max_tokens"]}
        chunks = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(body["max_tokens"])]
        chunks.append({"choices": [], "usage": usage})
        events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, "text/event-stream", events)

    def _send(self, status: int, content_type: str, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server() -> Iterator[str]:
    _FakeOpenAI.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _run_installed(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Python with the wheel's target folder first on the path, outside the repository, and with `-S`
    (no .pth files) so no editable install of kvserve can map `engine`, `server` or `benchmarks`
    back to a checkout; the environment's site-packages still provide the dependencies."""
    paths = dict.fromkeys(
        [str(installed), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_installed_packages_come_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    assert not (installed / "benchmarks").exists()
    probe = (
        "import importlib.util, engine, server.bench\n"
        "print(importlib.util.find_spec('benchmarks'))\n"
        "print(server.bench.__file__)\n"
        "print(engine.__file__)\n"
    )
    result = _run_installed(installed, tmp_path, "-c", probe)
    assert result.returncode == 0, result.stderr
    no_benchmarks, *files = result.stdout.split()
    assert no_benchmarks == "None", "a `benchmarks` package is importable next to the wheel"
    for line in files:
        assert Path(line).is_relative_to(installed), line


def test_kvserve_bench_help_runs_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    result = _run_installed(installed, tmp_path, "-m", "server", "bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "--concurrency" in result.stdout and "--request-rate" in result.stdout


def test_kvserve_bench_drives_a_server_from_the_installed_wheel(
    installed: Path, tmp_path: Path, fake_server: str
) -> None:
    out = tmp_path / "run.json"
    result = _run_installed(
        installed, tmp_path, "-m", "server", "bench", "--base-url", fake_server,
        "--tokenizer", "none", "--num-requests", "5", "--concurrency", "2", "--warmup", "1",
        "--input-len", "6", "--output-len", "3", "--no-progress", "--json-out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Output token throughput" in result.stdout
    metrics = json.loads(out.read_text())
    assert metrics["completed"] == 5 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == 15
    assert metrics["ttft_ms"]["median"] > 0
    assert metrics["config"]["model"] == "fake-model"
    assert len(_FakeOpenAI.bodies) == 6  # warm-up + 5
    assert all(b["model"] == "fake-model" and b["stream"] for b in _FakeOpenAI.bodies)
    assert all(len(b["prompt"].split()) == 6 for b in _FakeOpenAI.bodies)
