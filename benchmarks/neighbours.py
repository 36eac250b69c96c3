"""Plain decode beside busy neighbours: inter-token latency at concurrency 1 and output tokens/s at
concurrency 8, each with the machine as it is ("quiet") and with N busy processes beside the server
(`python -c 'while True: pass'`, the same niceness), for several kvserve variants (environment and
serve arguments) and optionally llama.cpp's llama-server. Rounds interleave the servers and alternate
quiet/busy, so drift hits every cell alike. A server that shares well loses about its share: with
N busy processes and T compute threads on T cores, busy/quiet about T / (T + N) for tokens/s.

    python -m benchmarks.neighbours --rounds 3 \
        --variant default= --variant passive="OMP_WAIT_POLICY=PASSIVE" \
        --llama-server $LLAMA_DIR/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchmarks.bench_utils import ServerProcess, cpu_summary, free_port
from server.bench import BenchConfig, run_benchmark

logger = logging.getLogger(__name__)

ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")
BUSY_LOOP = "while True: pass"


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """NAME=[ENV=VALUE ...] [serve args]: leading upper-case KEY=VALUE words are environment."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant NAME=[ENV=V ...] [args], got {text!r}")
    words = shlex.split(rest)
    env: dict[str, str] = {}
    while words and ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name, env, words


@contextmanager
def busy_neighbours(n: int) -> Iterator[None]:
    """n single-threaded spinning processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of `pid` and its children so far (NaN when unknown)."""
    import psutil

    if pid is None:
        return float("nan")
    try:
        proc = psutil.Process(pid)
        return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return float("nan")


def measure(
    base_url: str, args: argparse.Namespace, model: str | None, pid: int | None = None
) -> dict[str, float]:
    """c=1 median ITL (ms), c=8 output tokens/s and the server's CPU ms per output token at c=8
    (spin-waiting threads show there: CPU burnt for no token, robust to a loaded machine)."""
    common = {
        "base_url": base_url,
        "model": model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tokenizer": None,
        "progress": False,
        "max_seconds": args.max_seconds,
    }
    one = run_benchmark(BenchConfig(**common, num_requests=args.c1_requests, concurrency=1, seed=1))
    cpu0 = cpu_seconds(pid)
    many = run_benchmark(
        BenchConfig(**common, num_requests=args.c8_requests, concurrency=8, seed=2)
    )
    cpu = cpu_seconds(pid) - cpu0
    tokens = max(1, int(many["total_output_tokens"]))
    return {
        "itl_c1_ms": float(one["itl_ms"]["median"]),
        "tok_s_c8": float(many["output_throughput"]),
        "cpu_ms_per_token_c8": 1e3 * cpu / tokens,
        "failed": float(one["failed"] + many["failed"]),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="kvserve's model (default: the bundled GGUF)")
    p.add_argument("--server-args", default="", help="`kvserve serve` arguments of every variant")
    p.add_argument("--variant", type=parse_variant, action="append", help="NAME=[ENV=V ...] [args]")
    p.add_argument("--llama-server", default=None, help="a llama-server binary to measure too")
    p.add_argument("--gguf", default=None, help="llama-server's model (default: the bundled GGUF)")
    p.add_argument("--threads", type=int, default=2, help="compute threads of every server")
    p.add_argument("--busy", type=int, default=2, help="busy neighbour processes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128, help="prompt words")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--c1-requests", type=int, default=3)
    p.add_argument("--c8-requests", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json-out", default=None)
    return p


def start_servers(stack: ExitStack, args: argparse.Namespace) -> dict[str, ServerProcess]:
    from engine.models.loader import find_bundled_model, resolve_model

    model = str(resolve_model(args.model))
    log_dir = Path(args.log_dir)
    servers: dict[str, ServerProcess] = {}
    for name, env, extra in args.variant or [("kvserve", {}, [])]:
        port = free_port()
        argv = [sys.executable, "-m", "server", "serve", model, "--port", str(port)]
        argv += ["--threads", str(args.threads), *shlex.split(args.server_args), *extra]
        env = {"HF_HUB_OFFLINE": "1", **env}
        servers[name] = stack.enter_context(ServerProcess(f"nb-{name}", argv, port, log_dir, env))
    if args.llama_server:
        port = free_port()
        gguf = args.gguf or str(find_bundled_model())
        argv = [args.llama_server, "-m", gguf, "--port", str(port), "-t", str(args.threads)]
        argv += ["-tb", str(args.threads), "-np", "8", "-c", str(8 * 512), "--host", "127.0.0.1"]
        servers["llama.cpp"] = stack.enter_context(ServerProcess("nb-llama", argv, port, log_dir))
    for server in servers.values():
        server.wait_healthy(timeout=600)
    return servers


def table(cells: dict[str, dict[str, list[dict[str, float]]]], busy: int) -> str:
    lines = [
        f"| server | ITL c=1 quiet | ITL c=1, {busy} busy | ratio | tok/s c=8 quiet | "
        f"tok/s c=8, {busy} busy | ratio | CPU ms/token c=8 quiet | busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by in cells.items():
        q_itl = statistics.median(c["itl_c1_ms"] for c in by["quiet"])
        b_itl = statistics.median(c["itl_c1_ms"] for c in by["busy"])
        q_tok = statistics.median(c["tok_s_c8"] for c in by["quiet"])
        b_tok = statistics.median(c["tok_s_c8"] for c in by["busy"])
        q_cpu = statistics.median(c["cpu_ms_per_token_c8"] for c in by["quiet"])
        b_cpu = statistics.median(c["cpu_ms_per_token_c8"] for c in by["busy"])
        lines.append(
            f"| {name} | {q_itl:.1f} ms | {b_itl:.1f} ms | {b_itl / q_itl:.2f}x | {q_tok:.1f} | "
            f"{b_tok:.1f} | {b_tok / q_tok:.2f}x | {q_cpu:.1f} | {b_cpu:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(cpu_summary())
    print(
        f"neighbours: {args.rounds} rounds, {args.busy} busy processes, {args.threads} threads, "
        f"{os.cpu_count()} CPUs; medians over rounds"
    )
    cells: dict[str, dict[str, list[dict[str, float]]]] = {}
    with ExitStack() as stack:
        servers = start_servers(stack, args)
        names = list(servers)
        for name in names:  # warm-up: first-use work out of the figures
            measure(
                servers[name].base_url, argparse.Namespace(**{**vars(args), "c8_requests": 8}), None
            )
            cells[name] = {"quiet": [], "busy": []}
        for r in range(args.rounds):
            conditions = ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet")
            for condition in conditions:
                with busy_neighbours(args.busy if condition == "busy" else 0):
                    order = names[r % len(names) :] + names[: r % len(names)]
                    for name in order:
                        server = servers[name]
                        pid = server.proc.pid if server.proc is not None else None
                        m = measure(server.base_url, args, None, pid)
                        cells[name][condition].append(m)
                        logger.info("round %d %s %s: %s", r + 1, condition, name, m)
    print(table(cells, args.busy))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(cells, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
