"""Server processes for the repo's benchmark scripts: started on loopback, logging to a file, always
stopped; the CPU line benchmarks print with their figures. The request driver and statistics live in
the installed `server.bench` package."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from server.bench.driver import http_get

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess in its own process group, logging to a file; use as a context manager."""

    def __init__(
        self, name: str, argv: list[str], port: int, log_dir: Path, env: dict | None = None
    ):
        self.name, self.argv, self.port = name, argv, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}-{port}.log"
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting %s: %s (log %s)", self.name, " ".join(self.argv), self.log_path)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
        )
        log.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 300.0, path: str = "/health") -> float:
        """Block until GET `path` answers 200; return the seconds it took. Fails fast if it exits."""
        assert self.proc is not None
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if http_get(self.base_url + path, timeout=2.0)[0] == 200:
                    return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f}s; log {self.log_path}")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL after `grace` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def cpu_summary() -> str:
    """One line naming the CPU, torch's vector capability and the flags that decide weight formats."""
    from engine.models.cpu_features import detect_cpu

    return f"CPU: {detect_cpu().describe()}; torch {torch_version()}"


def torch_version() -> str:
    import torch

    return str(torch.__version__)
