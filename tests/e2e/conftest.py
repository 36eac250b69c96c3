"""Real `python -m server serve` processes on free ports, shared per session, plus client helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A kvserve server subprocess; `url` is its base (no /v1)."""

    def __init__(
        self, model: Path | str, args: list[str], log_path: Path, env: dict[str, str] | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "server", "serve", str(model), "--port", str(self.port), *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, headers: dict[str, str] | None = None) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        saw_503 = False
        self.startup_statuses: list[int] = []  # every /health status seen while starting
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                self.startup_statuses.append(r.status_code)
                if r.status_code == 200:
                    self.saw_loading_503 = saw_503
                    return
                saw_503 |= r.status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()[-4000:]}")

    def stats(self, headers: dict[str, str] | None = None) -> dict:
        return httpx.get(self.url + "/v1/internal/stats", headers=headers, timeout=10).json()

    def wait_idle(self, headers: dict[str, str] | None = None, timeout: float = 60) -> dict:
        """Poll until no request runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        stats: dict = {}
        while time.monotonic() < deadline:
            stats = self.stats(headers)
            if (
                stats["num_running"] == 0
                and stats["num_waiting"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]
            ):
                return stats
            time.sleep(0.1)
        raise AssertionError(f"engine not idle: {stats}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# Small pool and budgets keep the tiny model fast on CPU; block size 16 x 64 blocks = 1024 tokens.
TINY_ARGS = [
    "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--log-level", "warning",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_llama_dir, TINY_ARGS, tmp_path_factory.mktemp("logs") / "tiny.log")
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # No --dtype: the default a user gets (auto = the converted checkpoint's float32 on CPU).
    args = ["--device", "cpu", "--max-model-len", "1024", "--num-kv-blocks", "128",
            "--served-model-name", "smol", "--log-level", "warning"]  # fmt: skip
    server = ServerProcess(smollm2_dir, args, tmp_path_factory.mktemp("logs") / "smol.log")
    server.wait_ready()
    yield server
    server.stop()
