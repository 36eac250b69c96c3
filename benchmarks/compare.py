"""Side-by-side serving benchmark: start kvserve and a peer (default `transformers serve
--continuous-batching`) on loopback on the same model folder and dtype, run the same workloads on each
one after the other, and print every figure with the kvserve/peer ratio."""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench_utils import ServerProcess, free_port
from server.bench import BenchConfig, ratio, run_benchmark

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


def kvserve_target(model_dir: str, dtype: str, port: int, extra_args: str) -> Target:
    argv = [sys.executable, "-m", "server", "serve", model_dir, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--dtype", dtype, *shlex.split(extra_args)]
    return Target("kvserve", argv=argv, env={"HF_HUB_OFFLINE": "1"})


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
    )


def num_requests_for(concurrency: int, requested: int | None) -> int:
    """Enough requests to fill the batch twice (at least 4) unless the user fixed a count."""
    return requested if requested else max(4, 2 * concurrency)


def run_target(
    target: Target, args: argparse.Namespace, log_dir: Path, port: int
) -> dict[str, dict[str, Any]]:
    """Start the target (if ours), run each concurrency level, stop it; results keyed by concurrency."""
    results: dict[str, dict[str, Any]] = {}

    def workloads(base_url: str) -> None:
        for concurrency in args.concurrency:
            config = BenchConfig(
                base_url=base_url,
                endpoint=args.endpoint,
                input_len=args.input_len,
                output_len=args.output_len,
                num_requests=num_requests_for(concurrency, args.num_requests),
                max_seconds=args.max_seconds,
                concurrency=concurrency,
                ignore_eos=target.ignore_eos,
                extra_body=target.extra_body,
                tokenizer=args.model_dir,
                warmup=args.warmup,
                progress=not args.no_progress,
            )
            logger.info(
                "%s: concurrency %d, %d requests", target.name, concurrency, config.num_requests
            )
            try:
                m = run_benchmark(config)
            except (RuntimeError, OSError) as e:  # keep the other levels' figures
                logger.error("%s c=%d failed: %s", target.name, concurrency, e)
                results[str(concurrency)] = {"error": str(e)}
                continue
            results[str(concurrency)] = m
            logger.info(
                "%s c=%d: %.1f output tok/s, TTFT median %.0f ms, ITL median %.1f ms, failed %d",
                target.name,
                concurrency,
                m["output_throughput"],
                m["ttft_ms"]["median"],
                m["itl_ms"]["median"],
                m["failed"],
            )

    if target.url:
        workloads(target.url)
        return results
    assert target.argv is not None
    with ServerProcess(target.name, target.argv, port, log_dir, target.env) as server:
        startup = server.wait_healthy(timeout=args.startup_timeout)
        logger.info("%s healthy after %.1fs", target.name, startup)
        workloads(server.base_url)
    return results


def format_comparison(results: dict[str, dict[str, dict[str, Any]]], peer: str) -> str:
    """One block per concurrency: each figure for kvserve and the peer, and kvserve/peer."""
    kv, other = results.get("kvserve", {}), results.get(peer, {})
    lines = []
    for level in sorted(set(kv) | set(other), key=int):
        lines.append(f"\n== concurrency {level} ==")
        lines.append(f"{'figure':<18}{'kvserve':>12}{peer:>14}{'kvserve/peer':>14}")
        for label, key, stat in FIGURES:
            a, b = _figure(kv.get(level), key, stat), _figure(other.get(level), key, stat)
            lines.append(f"{label:<18}{_fmt(a):>12}{_fmt(b):>14}{_fmt(ratio(a, b), 2) + 'x':>14}")
    return "\n".join(lines)


def _figure(metrics: dict[str, Any] | None, key: str, stat: str | None) -> float:
    if not metrics or "error" in metrics:
        return math.nan
    value = metrics[key] if stat is None else metrics[key].get(stat, math.nan)
    return float(value)


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def _resolve_model_dir(model: str | None) -> str:
    from engine.models.loader import resolve_model

    return str(resolve_model(model))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--model", default=None, help="model folder or .gguf (default: the bundled SmolLM2)"
    )
    p.add_argument("--dtype", default="bfloat16", help="dtype for both servers (bf16, fp32, ...)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--num-requests", type=int, default=None, help="per level (default 2x concurrency, >= 4)"
    )
    p.add_argument("--max-seconds", type=float, default=180.0, help="time bound per level")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--peer", choices=("transformers", "none"), default="transformers", help="peer to start"
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
    return p


def _targets(args: argparse.Namespace) -> tuple[list[Target], str]:
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    kv = (
        Target("kvserve", url=args.kvserve_url)
        if args.kvserve_url
        else kvserve_target(args.model_dir, dtype, 0, args.kvserve_args)
    )
    targets = [kv]
    if args.peer_url:
        name = args.peer_name or "peer"
        targets.append(Target(name, url=args.peer_url, ignore_eos=not args.peer_no_ignore_eos))
    elif args.peer == "transformers":
        sizing = transformers_cb_args(
            max(args.concurrency), args.input_len + args.output_len + 64, args.max_batch_tokens
        )
        peer_args = sizing + shlex.split(args.peer_args)  # later flags win
        targets.append(transformers_target(args.model_dir, dtype, 0, args.output_len, peer_args))
    peer = targets[1].name if len(targets) > 1 else "peer"
    return targets, peer


def _with_port(target: Target, port: int) -> Target:
    if target.argv is None:
        return target
    argv = list(target.argv)
    argv[argv.index("--port") + 1] = str(port)
    return Target(target.name, argv, target.url, target.ignore_eos, target.extra_body, target.env)


def _raise_on_sigterm() -> None:
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through `with ServerProcess`, stopping servers

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
        args.model_dir = _resolve_model_dir(args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _raise_on_sigterm()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvserve-compare-"))
    targets, peer = _targets(args)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    status = 0
    for target in targets:
        try:  # one server at a time: they would otherwise share the same cores
            port = free_port()
            results[target.name] = run_target(_with_port(target, port), args, log_dir, port)
        except (RuntimeError, OSError) as e:
            logger.error("%s failed: %s", target.name, e)
            status = 1
    print(format_comparison(results, peer))
    print(f"\nmodel {args.model_dir}, dtype {args.dtype}, server logs in {log_dir}")
    if args.json_out:
        payload = {
            "model": args.model_dir,
            "dtype": args.dtype,
            "peer": peer,
            "results": results,
            "ratios": _ratios(results, peer),
        }
        Path(args.json_out).write_text(json.dumps(payload, indent=2))
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
