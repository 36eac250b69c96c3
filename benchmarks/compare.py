"""Side-by-side serving benchmark: start kvserve and a peer (`transformers serve --continuous-batching`
on the same model folder and dtype, or llama.cpp's `llama-server` on the bundled GGUF file) on loopback,
run the same workloads on each, alternating peers level by level and round by round in one run, and
print every figure (medians over rounds) with the kvserve/peer ratio and the CPU's flags."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench_utils import ServerProcess, free_port
from benchmarks.compare_report import (
    StreamingLimit,
    fmt_ratio,
    fmt_value,
    format_file_summary,
    format_markdown,
)
from benchmarks.llama_cpp_peer import (
    has_option,
    llama_cpp_argv,
    llama_cpp_build_isa,
    llama_cpp_help,
)
from server.bench import BenchConfig, ratio, run_benchmark
from server.bench.driver import HTTP_CLIENTS, resolve_http_client

logger = logging.getLogger(__name__)

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}

# (label, metrics key, stat or None)
FIGURES = [
    ("completed", "completed", None),
    ("req/s", "request_throughput", None),
    ("output tok/s", "output_throughput", None),
    ("streamed tok/s", "streamed_output_throughput", None),
    ("total tok/s", "total_token_throughput", None),
    *[
        (f"{name} {stat} ms", key, stat)
        for name, key in (
            ("TTFT", "ttft_ms"),
            ("TPOT", "tpot_ms"),
            ("ITL", "itl_ms"),
            ("E2E", "e2e_ms"),
        )
        for stat in ("mean", "median", "p99")
    ],
]


@dataclass
class Target:
    """One server to benchmark: started by us (argv) or already running (url)."""

    name: str
    argv: list[str] | None = None
    url: str | None = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    polls_when_idle: bool = False  # burns CPU while idle: never kept running beside another


def kvserve_target(
    model: str, dtype: str, port: int, extra_args: str, threads: int | None = None
) -> Target:
    """kvserve on a model folder or a .gguf file (its blocks served as stored)."""
    argv = [sys.executable, "-m", "server", "serve", model, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--dtype", dtype]
    argv += ["--threads", str(threads)] if threads else []
    return Target("kvserve", argv=[*argv, *shlex.split(extra_args)], env={"HF_HUB_OFFLINE": "1"})


def transformers_cb_args(max_concurrency: int, max_len: int, max_batch_tokens: int) -> list[str]:
    """KV pool and batch sizes for `transformers serve`: on CPU it otherwise sizes its cache from 60-90%
    of the machine's RAM (and was OOM-killed at 11 GB here). Pages hold 256 tokens."""
    pages_per_request = -(-max_len // 256)
    num_blocks = max(16, 2 * max_concurrency * pages_per_request)
    return ["--cb-num-blocks", str(num_blocks), "--cb-max-batch-tokens", str(max_batch_tokens)]


def transformers_target(
    model_dir: str, dtype: str, port: int, output_len: int, extra_args: list[str]
) -> Target:
    """`transformers serve` rejects unknown request fields such as ignore_eos (HTTP 422), but accepts a
    `generation_config` JSON string: min_new_tokens = max_new_tokens gives the same fixed lengths."""
    exe = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
    argv = [exe, "serve", "--continuous-batching", "--dtype", dtype, "--host", "127.0.0.1"]
    argv += ["--port", str(port), *extra_args, model_dir]
    gen = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False}
    return Target(
        "transformers",
        argv=argv,
        ignore_eos=False,
        extra_body={"generation_config": json.dumps(gen)},
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        polls_when_idle=True,  # its continuous-batching loop spins (~30% of a core) while idle
    )


def cpu_summary() -> str:
    """The CPU model, its SIMD flags that matter to kernels, and torch's detected capability."""
    model, flags = platform.processor() or platform.machine(), set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "asimd")
    shown = [f for f in wanted if f in flags]
    capability = "unknown"
    with contextlib.suppress(ImportError, AttributeError):
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"CPU {model}, {os.cpu_count()} logical cores, flags: {' '.join(shown) or 'none of interest'}"
        f"{'' if 'avx512f' in flags else ' (no AVX-512)'}; torch CPU capability {capability}"
    )


def num_requests_for(concurrency: int, requested: int | None) -> int:
    """Enough requests to fill the batch twice (at least 4) unless the user fixed a count."""
    return requested if requested else max(4, 2 * concurrency)


LONG_SEED = 1_000_000  # long-prompt seeds never meet a short level's (1000 * round + concurrency)


@dataclass(frozen=True)
class Level:
    """One workload every target runs each round: `key` names it in the results ("8", "long1024")."""

    key: str
    concurrency: int
    input_len: int
    output_len: int
    num_requests: int
    warmup: int
    seed_base: int  # + 1000 * round: same prompts for every target, new ones every round

    def seed(self, rnd: int) -> int:
        return self.seed_base + 1000 * rnd


def levels_for(args: argparse.Namespace) -> list[Level]:
    """The concurrency levels, then the long-prompt levels: concurrency 1, `--long-requests`
    prompts of each length and `--long-output-len` tokens (enough for a TTFT), no warm-up (the short
    levels warmed the server up), their own seeds so no prompt shares a prefix with another level's
    or another round's (a random-word prompt is a prefix of a longer one from the same seed)."""
    levels = [
        Level(
            str(c),
            c,
            args.input_len,
            args.output_len,
            num_requests_for(c, args.num_requests),
            args.warmup,
            c,
        )  # fmt: skip
        for c in args.concurrency
    ]
    for length in args.long_prompts:
        levels.append(
            Level(
                f"long{length}",
                1,
                length,
                args.long_output_len,
                args.long_requests,
                0,
                LONG_SEED + 100 * length,
            )  # fmt: skip
        )
    return levels


def max_request_len(args: argparse.Namespace) -> tuple[int, int]:
    """Tokens one request may need (prompt + output + template slack): the short levels' and the
    longest long-prompt level's."""
    short = args.input_len + args.output_len + 64
    longest = max((n + args.long_output_len + 64 for n in args.long_prompts), default=0)
    return short, longest


def run_level(
    target: Target, base_url: str, level: Level, args: argparse.Namespace, rnd: int = 0
) -> dict[str, Any]:
    """One level against a running target: its metrics, or {"error": ...}. The prompts are seeded
    by round and level: every target gets the same ones, but no round or level repeats an earlier
    one, so neither server's prefix cache answers a prompt it has already seen."""
    config = BenchConfig(
        seed=level.seed(rnd),
        base_url=base_url,
        endpoint=args.endpoint,
        input_len=level.input_len,
        output_len=level.output_len,
        num_requests=level.num_requests,
        max_seconds=args.max_seconds,
        concurrency=level.concurrency,
        ignore_eos=target.ignore_eos,
        extra_body=target.extra_body,
        tokenizer=args.model_dir,
        warmup=level.warmup,
        progress=not args.no_progress,
        http_client=args.http_client,
    )
    logger.info("%s: level %s, %d requests", target.name, level.key, config.num_requests)
    try:
        m = run_benchmark(config)
    except (RuntimeError, OSError) as e:  # keep the other levels' figures
        logger.error("%s level %s failed: %s", target.name, level.key, e)
        return {"error": str(e)}
    logger.info(
        "%s %s: %.1f output tok/s, TTFT median %.0f ms, ITL median %.1f ms, failed %d",
        target.name,
        level.key,
        m["output_throughput"],
        m["ttft_ms"]["median"],
        m["itl_ms"]["median"],
        m["failed"],
    )
    return m


def run_interleaved(
    targets: list[Target], args: argparse.Namespace, log_dir: Path
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every round runs every level on every target, the first target alternating by round, so slow
    drifts in machine load hit all of them alike. Servers that idle quietly (kvserve, llama.cpp) are
    all started once and take turns level by level; if one polls while idle, each round starts one
    server at a time instead. Returns name -> level key -> one metrics dict per round."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t.name: {} for t in targets}
    levels = levels_for(args)
    together = not any(t.polls_when_idle and t.url is None for t in targets)
    with contextlib.ExitStack() as stack:
        urls = _start_all(targets, args, log_dir, stack) if together else {}
        for rnd in range(args.rounds):
            order = targets if rnd % 2 == 0 else targets[::-1]  # neither always goes first
            if together:
                for level in levels:
                    for target in order:
                        if target.name in urls:
                            m = run_level(target, urls[target.name], level, args, rnd)
                            runs[target.name].setdefault(level.key, []).append(m)
                continue
            for target in order:
                with contextlib.ExitStack() as one:
                    url = _start_all([target], args, log_dir, one).get(target.name, "")
                    for level in levels if url else []:
                        m = run_level(target, url, level, args, rnd)
                        runs[target.name].setdefault(level.key, []).append(m)
    return runs


def _start_all(
    targets: list[Target], args: argparse.Namespace, log_dir: Path, stack: contextlib.ExitStack
) -> dict[str, str]:
    """Base URL of every target that is running or started healthy (stopped when `stack` closes)."""
    urls: dict[str, str] = {}
    for target in targets:
        if target.url:
            urls[target.name] = target.url
            continue
        port = free_port()
        argv = _with_port(target, port).argv or []
        try:
            server = stack.enter_context(
                ServerProcess(target.name, argv, port, log_dir, target.env)
            )
            startup = server.wait_healthy(timeout=args.startup_timeout)
        except (RuntimeError, OSError) as e:
            logger.error("%s failed to start: %s", target.name, e)
            continue
        logger.info("%s healthy after %.1fs", target.name, startup)
        urls[target.name] = server.base_url
    return urls


def median_metrics(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over the rounds that succeeded (an error if none did)."""
    ok = [m for m in rounds if "error" not in m]
    if not ok:
        return {"error": rounds[0]["error"] if rounds else "no run"}
    merged: dict[str, Any] = {"rounds": len(ok)}
    for _, key, stat in FIGURES:
        if stat is None:
            merged[key] = statistics.median(float(m[key]) for m in ok)
        else:
            values = [float(m[key].get(stat, math.nan)) for m in ok]
            merged.setdefault(key, {})[stat] = statistics.median(values)
    return merged


def format_comparison(results: dict[str, dict[str, dict[str, Any]]], peer: str) -> str:
    """One block per concurrency: each figure for kvserve and the peer, and kvserve/peer."""
    kv, other = results.get("kvserve", {}), results.get(peer, {})
    lines = []
    for level in sorted(set(kv) | set(other), key=level_order):
        heading = f"concurrency {level}" if level.isdigit() else f"{level[4:]}-token prompts, c=1"
        lines.append(f"\n== {heading} ==")
        lines.append(f"{'figure':<18}{'kvserve':>12}{peer:>14}{'kvserve/peer':>14}")
        for label, key, stat in FIGURES:
            a, b = _figure(kv.get(level), key, stat), _figure(other.get(level), key, stat)
            lines.append(
                f"{label:<18}{fmt_value(a):>12}{fmt_value(b):>14}{fmt_ratio(ratio(a, b)):>14}"
            )
    return "\n".join(lines)


def level_order(key: str) -> tuple[int, int]:
    """Concurrency levels ("8") by concurrency, then long-prompt levels ("long1024") by length."""
    return (0, int(key)) if key.isdigit() else (1, int(key.removeprefix("long")))


def _figure(metrics: dict[str, Any] | None, key: str, stat: str | None) -> float:
    if not metrics or "error" in metrics:
        return math.nan
    value = metrics[key] if stat is None else metrics[key].get(stat, math.nan)
    return float(value)


def _resolve_model_dir(model: str | None) -> str:
    from engine.models.loader import resolve_model

    return str(resolve_model(model))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--model", default=None, help="model folder or .gguf (default: the bundled SmolLM2)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="dtype for kvserve (and the transformers peer): auto (kvserve's default), bf16, fp32, ...",
    )
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--num-requests", type=int, default=None, help="per level (default 2x concurrency, >= 4)"
    )
    p.add_argument(
        "--long-prompts",
        default="",
        help="comma-separated prompt lengths (e.g. 1024,4096): TTFT at concurrency 1 with prompts "
        "that long, new ones every round (no prefix-cache help)",
    )
    p.add_argument("--long-requests", type=int, default=2, help="requests per long-prompt level")
    p.add_argument(
        "--long-output-len", type=int, default=8, help="output tokens of a long-prompt request"
    )
    p.add_argument("--max-seconds", type=float, default=180.0, help="time bound per level")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--peer",
        choices=("transformers", "llama.cpp", "none"),
        default=None,
        help="peer to start (default: llama.cpp when --llama-server is given, else transformers)",
    )
    p.add_argument(
        "--llama-server", default=None, help="path of a llama.cpp `llama-server` binary to start"
    )
    p.add_argument(
        "--gguf",
        default=None,
        help="comma-separated GGUF files, one after the other: each served by kvserve (its blocks "
        "as stored) and by llama.cpp (default with --llama-server: the bundled SmolLM2 Q4_1)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads of both servers (kvserve --threads, llama.cpp --threads and "
        "--threads-batch); default: each server's own",
    )
    p.add_argument(
        "--peer-threads", type=int, default=None, help="llama.cpp threads (default: all cores)"
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat every level, alternating peers; medians shown"
    )
    p.add_argument(
        "--peer-url", default=None, help="an already running OpenAI-compatible peer instead"
    )
    p.add_argument("--peer-name", default=None, help="label for --peer-url")
    p.add_argument(
        "--peer-no-ignore-eos", action="store_true", help="--peer-url rejects ignore_eos"
    )
    p.add_argument("--peer-args", default="", help="extra arguments for the started peer")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="token budget per step given to the transformers peer (kvserve's default budget)",
    )
    p.add_argument(
        "--kvserve-url", default=None, help="an already running kvserve instead of starting one"
    )
    p.add_argument("--kvserve-args", default="", help="extra arguments for `kvserve serve`")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default="auto",
        help="the load generator's HTTP client (auto: aiohttp where installed; it shares the "
        "CPUs with both servers, at about half httpx's CPU a streamed chunk)",
    )
    return p


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError as e:
        raise ValueError(f"{option} takes comma-separated integers, not {text!r}") from e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed and checked options (ValueError with the message for the user): lists split, the
    peer chosen, the GGUF files listed (`args.files`: None means kvserve serves `--model`)."""
    args = build_parser().parse_args(argv)
    if args.peer is None:
        args.peer = "llama.cpp" if args.llama_server else "transformers"
    args.concurrency = _int_list(args.concurrency, "--concurrency")
    if not args.concurrency or min(args.concurrency) < 1 or args.rounds < 1:
        raise ValueError("--concurrency needs levels >= 1 and --rounds must be >= 1")
    args.long_prompts = _int_list(args.long_prompts, "--long-prompts")
    if args.long_prompts and (min(args.long_prompts) < 1 or args.long_requests < 1):
        raise ValueError("--long-prompts lengths and --long-requests must be >= 1")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise ValueError(f"--llama-server {args.llama_server!r} is not an executable file")
    if args.peer == "llama.cpp" and not args.llama_server and not args.peer_url:
        raise ValueError("--peer llama.cpp needs --llama-server PATH (a llama-server binary)")
    files = [f.strip() for f in (args.gguf or "").split(",") if f.strip()]
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"--gguf {f!r} is not a file")
    if files and args.peer == "transformers" and not args.peer_url:
        raise ValueError("--gguf is for the llama.cpp peer (--llama-server PATH) or --peer none")
    if not files and args.peer == "llama.cpp" and not args.peer_url:
        files = [str(_bundled_gguf())]
    args.files = files or [None]
    return args


def _targets(args: argparse.Namespace, gguf: str | None) -> tuple[list[Target], str]:
    """kvserve serves `gguf` (its blocks as stored) if given, else the `--model` folder."""
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    kv = (
        Target("kvserve", url=args.kvserve_url)
        if args.kvserve_url
        else kvserve_target(gguf or args.model_dir, dtype, 0, args.kvserve_args, args.threads)
    )
    targets = [kv]
    if args.peer_url:
        name = args.peer_name or "peer"
        targets.append(Target(name, url=args.peer_url, ignore_eos=not args.peer_no_ignore_eos))
    elif args.peer == "llama.cpp":
        assert gguf is not None  # parse_args gives the llama.cpp peer a file
        max_len, longest = max_request_len(args)
        threads = args.peer_threads or args.threads or os.cpu_count() or 1
        help_text = llama_cpp_help(args.llama_server)
        argv = llama_cpp_argv(
            args.llama_server, gguf, 0, max(args.concurrency), max_len, threads,
            shlex.split(args.peer_args), longest, has_option(help_text, "--kv-unified"),
        )  # fmt: skip
        targets.append(Target("llama.cpp", argv=argv))
    elif args.peer == "transformers":
        sizing = transformers_cb_args(
            max(args.concurrency), args.input_len + args.output_len + 64, args.max_batch_tokens
        )
        peer_args = sizing + shlex.split(args.peer_args)  # later flags win
        targets.append(transformers_target(args.model_dir, dtype, 0, args.output_len, peer_args))
    peer = targets[1].name if len(targets) > 1 else "peer"
    return targets, peer


def _bundled_gguf() -> Path:
    from engine.models.loader import find_bundled_model

    return find_bundled_model()


def _with_port(target: Target, port: int) -> Target:
    if target.argv is None:
        return target
    argv = list(target.argv)
    argv[argv.index("--port") + 1] = str(port)
    return dataclasses.replace(target, argv=argv)


def _raise_on_sigterm() -> None:
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through `with ServerProcess`, stopping servers

    signal.signal(signal.SIGTERM, handler)


def _read_gbps(threads: int | None) -> float:
    """The machine's streaming read bandwidth (benchmarks/roofline.py's measurement)."""
    import torch

    from benchmarks.roofline import memory_bandwidth

    if threads:
        torch.set_num_threads(threads)
    return memory_bandwidth(min_seconds=1.0)["read_gbps"]


def _streaming_limit(
    gguf: str, args: argparse.Namespace, probes_gbps: list[float]
) -> StreamingLimit:
    """The file's limit with the median of the read-bandwidth probes taken around its run (the
    machines are shared: one probe moved 30-57 GB/s between moments of the same day)."""
    from benchmarks.gguf_files import describe

    context = args.input_len + args.output_len // 2  # the mean context of a c=1 decode step
    return StreamingLimit(
        describe(gguf, context)["bytes_per_token"],
        statistics.median(probes_gbps),
        context,
        tuple(probes_gbps),
    )


def _type_line(gguf: str) -> str:
    from benchmarks.gguf_files import format_histogram, read_tensors, type_histogram

    return format_histogram(Path(gguf).name, type_histogram(read_tensors(gguf)[0]))


def run_one(
    args: argparse.Namespace, gguf: str | None, log_dir: Path, cpu: str, read_gbps: float | None
) -> tuple[dict[str, Any], StreamingLimit | None, float | None]:
    """Both servers on one model (file): every level, every round; prints and returns the payload,
    the file's streaming limit and the read bandwidth probed after the run (with `read_gbps`, the
    one before it, the limit's probes)."""
    args.model_dir = _resolve_model_dir(gguf or args.model)  # also the prompts' tokenizer
    targets, peer = _targets(args, gguf)
    runs = run_interleaved(targets, args, log_dir)
    results = {
        name: {level: median_metrics(rounds) for level, rounds in levels.items()}
        for name, levels in runs.items()
    }
    print(format_comparison(results, peer))
    after = _read_gbps(args.threads) if gguf and read_gbps else None
    limit = (
        _streaming_limit(gguf, args, [read_gbps, after]) if gguf and read_gbps and after else None
    )
    if gguf:
        title = _type_line(gguf)
        print(
            format_file_summary(
                title, results.get("kvserve", {}), results.get(peer, {}), peer, limit
            )
        )
    print(
        f"\nmodel {gguf or args.model_dir}, kvserve dtype {args.dtype}, medians of {args.rounds} "
        f"round(s), client {resolve_http_client(args.http_client)}, server logs in {log_dir}\n{cpu}"
    )
    payload = {
        "model": gguf or args.model_dir,
        "dtype": args.dtype,
        "peer": peer,
        "cpu": cpu,
        "rounds": args.rounds,
        "peer_argv": targets[1].argv if len(targets) > 1 else None,
        "streaming_limit": dataclasses.asdict(limit) if limit else None,
        "results": results,
        "runs": runs,
        "ratios": _ratios(results, peer),
    }
    return payload, limit, after


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        args = parse_args(argv)
        if args.files == [None]:
            args.model_dir = _resolve_model_dir(args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _raise_on_sigterm()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvserve-compare-"))
    cpu = cpu_summary()
    if args.llama_server:
        cpu += f"; {llama_cpp_build_isa(args.llama_server)}"
    logger.info("%s", cpu)
    read_gbps = _read_gbps(args.threads) if args.files != [None] else None
    payloads, rows = [], []
    for gguf in args.files:
        try:
            payload, limit, after = run_one(args, gguf, log_dir, cpu, read_gbps)
        except ValueError as e:  # a file kvserve cannot read: keep the others
            logger.error("%s: %s", gguf, e)
            payloads.append({"model": gguf, "error": str(e)})
            continue
        payloads.append(payload)
        read_gbps = after or read_gbps  # the next file's probe before
        if gguf:
            peer = payload["peer"]
            res = payload["results"]
            rows.append((Path(gguf).name, res.get("kvserve", {}), res.get(peer, {}), limit))
    if len(rows) > 1:
        print("\n" + format_markdown(rows))
    status = 0 if all("error" not in p and all(p["results"].values()) for p in payloads) else 1
    if args.json_out:
        out = payloads[0] if len(payloads) == 1 else {"cpu": cpu, "files": payloads}
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return status


def _ratios(
    results: dict[str, dict[str, dict[str, Any]]], peer: str
) -> dict[str, dict[str, float]]:
    kv, other = results.get("kvserve", {}), results.get(peer, {})
    out: dict[str, dict[str, float]] = {}
    for level in set(kv) & set(other):
        out[level] = {
            label: ratio(_figure(kv[level], key, stat), _figure(other[level], key, stat))
            for label, key, stat in FIGURES
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
