"""What serving costs beyond the model: a real `kvserve serve` process whose model forward and lm_head
are replaced by ready tensors (and, with --forward-ms, a sleep that stands in for a forward that
releases the GIL, as torch's kernels do), driven by `kvserve bench` with streamed requests. Prints per
output token the CPU time of the server's event-loop thread (HTTP, SSE, hand-offs) and of its other
threads (the engine step), the gap between two engine steps, and the client's inter-token latency;
Linux only (per-thread CPU from /proc). Figures, never assertions."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_utils import ServerProcess, cpu_summary, free_port
from server.bench import BenchConfig, run_benchmark


def _serve(argv: list[str]) -> int:
    """The server side: stub the model of the engine the CLI builds, record each step's start and
    end, and write them to --marks-out at exit."""
    p = argparse.ArgumentParser()
    p.add_argument("--forward-ms", type=float, default=0.0)
    p.add_argument("--marks-out", required=True)
    args, rest = p.parse_known_args(argv)

    import atexit

    import engine.llm_engine as llm_engine
    from benchmarks.step_profile import stub_model
    from server.cli import main

    marks: list[tuple[float, float, int]] = []
    init = llm_engine.LLMEngine.__init__

    def stubbed_init(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        stub_model(self.model, self.dtype)
        forward = self.model.forward
        delay = args.forward_ms / 1e3

        def slow_forward(*fa: Any, **fkw: Any) -> Any:
            time.sleep(delay)
            return forward(*fa, **fkw)

        if delay:
            self.model.forward = slow_forward
        step = self.step

        def timed_step() -> Any:
            t0 = time.perf_counter()
            outputs = step()
            marks.append((t0, time.perf_counter(), len(outputs)))
            return outputs

        self.step = timed_step

    llm_engine.LLMEngine.__init__ = stubbed_init  # type: ignore[method-assign]
    atexit.register(lambda: Path(args.marks_out).write_text(json.dumps(marks)))
    return main(rest)


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of `pid`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _step_gaps(marks: list[list[float]]) -> tuple[float, float]:
    """Median step time and median gap between consecutive steps that both produced outputs (ms);
    gaps over 50 ms (the server idle between requests) are left out."""
    busy = [m for m in marks if m[2]]
    gaps = [b[0] - a[1] for a, b in zip(marks, marks[1:], strict=False) if a[2] and b[2]]
    gaps = [g for g in gaps if g < 0.05]
    step = statistics.median(m[1] - m[0] for m in busy) if busy else float("nan")
    gap = statistics.median(gaps) if gaps else float("nan")
    return 1e3 * step, 1e3 * gap


def measure(concurrency: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    marks_path = log_dir / f"marks-{port}.json"
    argv = [
        sys.executable, "-m", "benchmarks.serving_overhead", "--serve",
        "--forward-ms", str(args.forward_ms), "--marks-out", str(marks_path),
        "serve", "--port", str(port), "--threads", "1", "--log-stats-interval", "0",
        "--max-num-seqs", str(max(64, concurrency)), *args.kvserve_args.split(),
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1"}
    with ServerProcess(f"stubbed-c{concurrency}", argv, port, log_dir, env) as server:
        server.wait_healthy()
        assert server.proc is not None
        pid = server.proc.pid
        config = BenchConfig(
            base_url=server.base_url,
            endpoint=args.endpoint,
            input_len=args.input_len,
            output_len=args.output_len,
            num_requests=args.requests_per_level * concurrency,
            concurrency=concurrency,
            warmup=1,
            progress=False,
        )
        run_benchmark(BenchConfig(**{**config.__dict__, "num_requests": concurrency}))  # warm-up
        before = _thread_cpu(pid)
        result = run_benchmark(config)
        after = _thread_cpu(pid)
        server.stop()
    tokens = max(1, result["total_output_tokens"])
    loop_cpu = after.get(pid, 0.0) - before.get(pid, 0.0)
    other_cpu = sum(v - before.get(t, 0.0) for t, v in after.items() if t != pid)
    step_ms, gap_ms = _step_gaps(json.loads(marks_path.read_text()))
    return {
        "concurrency": concurrency,
        "output_tokens": tokens,
        "loop_thread_ms_per_token": 1e3 * loop_cpu / tokens,
        "other_threads_ms_per_token": 1e3 * other_cpu / tokens,
        "step_ms": step_ms,
        "step_gap_ms": gap_ms,
        "itl_median_ms": result["itl_ms"]["median"],
        "output_tok_s": result["output_throughput"],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return _serve(argv[1:])
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", default="1,32", help="comma-separated concurrency levels")
    p.add_argument("--forward-ms", type=float, default=10.0, help="stand-in forward time")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-level", type=int, default=4, help="requests per concurrency")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--kvserve-args", default="", help="extra arguments for `kvserve serve`")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    print(cpu_summary())
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-overhead-") as tmp:
        for c in (int(x) for x in args.concurrency.split(",") if x):
            row = measure(c, args, Path(tmp))
            rows.append(row)
            print(
                f"c={c}: event-loop thread {row['loop_thread_ms_per_token']:.3f} ms CPU/token, "
                f"other threads {row['other_threads_ms_per_token']:.3f} ms CPU/token | step "
                f"{row['step_ms']:.2f} ms (forward stand-in {args.forward_ms:g} ms), gap between "
                f"steps {row['step_gap_ms']:.3f} ms | ITL median {row['itl_median_ms']:.2f} ms, "
                f"{row['output_tok_s']:.0f} tok/s"
            )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
