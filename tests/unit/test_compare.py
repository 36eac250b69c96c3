"""benchmarks/compare.py without servers: options, the llama.cpp peer's command line, the levels
(long prompts included), interleaving and medians."""

from __future__ import annotations

import os
import stat as statmod

import pytest

from benchmarks import compare


def _server(tmp_path, help_text=""):
    """A stand-in llama-server: prints `help_text` for --help."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}\nEOF\nexit 1\n")
    binary.chmod(binary.stat().st_mode | statmod.S_IEXEC)
    return binary


def _args(tmp_path, *extra, help_text=""):
    binary = _server(tmp_path, help_text)
    args = compare.parse_args(["--llama-server", str(binary), *extra])
    args.model_dir = str(tmp_path)
    return args, binary


def _gguf(tmp_path, name="m.gguf"):
    path = tmp_path / name
    path.write_bytes(b"GGUF")
    return path


def test_llama_cpp_peer_gets_a_slot_per_concurrent_request(tmp_path):
    gguf = _gguf(tmp_path)
    args, binary = _args(tmp_path, "--gguf", str(gguf), "--peer-threads", "3")
    targets, peer = compare._targets(args, args.files[0])
    assert peer == "llama.cpp" and [t.name for t in targets] == ["kvserve", "llama.cpp"]
    argv = targets[1].argv
    assert argv[0] == str(binary) and argv[argv.index("-m") + 1] == str(gguf)
    assert "--kv-unified" not in argv  # this build's --help does not list it
    slots = int(argv[argv.index("--parallel") + 1])
    ctx = int(argv[argv.index("--ctx-size") + 1])
    assert slots == 32  # the highest concurrency level
    assert ctx // slots >= 128 + 64  # every slot holds a whole request
    assert argv[argv.index("--threads") + 1] == "3"
    assert targets[1].ignore_eos  # llama-server honours ignore_eos: same output lengths
    port_argv = compare._with_port(targets[1], 4321).argv
    assert port_argv[port_argv.index("--port") + 1] == "4321"


def test_llama_cpp_peer_defaults_to_the_bundled_gguf(tmp_path):
    args, _ = _args(tmp_path)
    assert len(args.files) == 1
    targets = compare._targets(args, args.files[0])[0]
    argv = targets[1].argv
    gguf = argv[argv.index("-m") + 1]
    assert gguf.endswith(".gguf") and os.path.isfile(gguf)
    assert targets[0].argv[targets[0].argv.index("serve") + 1] == gguf  # kvserve: the same file


def test_every_gguf_file_is_served_by_both_with_the_same_threads(tmp_path):
    a, b = _gguf(tmp_path, "a.gguf"), _gguf(tmp_path, "b.gguf")
    args, _ = _args(tmp_path, "--gguf", f"{a}, {b}", "--threads", "2")
    assert args.files == [str(a), str(b)]
    kv, llama = compare._targets(args, str(b))[0]
    assert kv.argv[kv.argv.index("serve") + 1] == str(b)
    assert kv.argv[kv.argv.index("--threads") + 1] == "2"
    assert llama.argv[llama.argv.index("-m") + 1] == str(b)
    assert llama.argv[llama.argv.index("--threads") + 1] == "2"
    assert llama.argv[llama.argv.index("--threads-batch") + 1] == "2"


def test_long_prompts_fit_a_llama_cpp_slot(tmp_path):
    """Each slot gets ctx/parallel tokens unless the KV cache is unified (then any slot may use
    the whole context): either way a 4096-token prompt must fit."""
    args, _ = _args(tmp_path, "--long-prompts", "1024,4096")
    argv = compare._targets(args, args.files[0])[0][1].argv
    ctx, slots = int(argv[argv.index("--ctx-size") + 1]), int(argv[argv.index("--parallel") + 1])
    assert ctx // slots >= 4096 + args.long_output_len
    help_text = "-kvu, --kv-unified    use single unified KV buffer"
    args, _ = _args(tmp_path, "--long-prompts", "1024,4096", help_text=help_text)
    argv = compare._targets(args, args.files[0])[0][1].argv
    ctx = int(argv[argv.index("--ctx-size") + 1])
    assert "--kv-unified" in argv
    assert ctx >= 4096 + args.long_output_len and ctx >= 32 * (128 + 64)
    assert ctx < 32 * 4096  # not a 4096-token slot each


def test_option_errors_are_usage_errors(tmp_path, capsys):
    binary = str(_server(tmp_path))
    assert compare.main(["--llama-server", binary, "--gguf", str(tmp_path / "no.gguf")]) == 1
    assert "is not a file" in capsys.readouterr().err
    assert compare.main(["--peer", "transformers", "--gguf", str(_gguf(tmp_path))]) == 1
    assert "--gguf is for the llama.cpp peer" in capsys.readouterr().err
    assert compare.main(["--llama-server", binary, "--long-prompts", "1k"]) == 1
    assert "comma-separated integers" in capsys.readouterr().err
    assert compare.main(["--peer", "llama.cpp"]) == 1
    assert "needs --llama-server" in capsys.readouterr().err


def test_levels_concurrency_then_long_prompts_with_their_own_prompts(tmp_path):
    args, _ = _args(tmp_path, "--long-prompts", "1024,4096", "--long-requests", "1")
    levels = compare.levels_for(args)
    assert [lv.key for lv in levels] == ["1", "8", "32", "long1024", "long4096"]
    long1024 = levels[3]
    assert (long1024.concurrency, long1024.input_len, long1024.num_requests) == (1, 1024, 1)
    assert long1024.warmup == 0 and long1024.output_len == args.long_output_len
    seeds = [lv.seed(rnd) for rnd in range(3) for lv in levels]
    assert len(set(seeds)) == len(seeds)  # no two levels or rounds share a prompt
    assert [lv.key for lv in levels] == sorted((lv.key for lv in levels), key=compare.level_order)


def test_bad_llama_server_path_is_a_usage_error(tmp_path, capsys):
    code = compare.main(["--llama-server", str(tmp_path / "missing"), "--rounds", "1"])
    assert code == 1 and "not an executable" in capsys.readouterr().err


def _metrics(tok_s, ttft):
    figures = {key: tok_s for _, key, stat in compare.FIGURES if stat is None}
    for _, key, stat in compare.FIGURES:
        if stat is not None:
            figures.setdefault(key, {})[stat] = ttft
    return figures


def test_median_over_rounds_skips_failed_rounds():
    rounds = [
        _metrics(10.0, 300.0),
        {"error": "boom"},
        _metrics(30.0, 100.0),
        _metrics(20.0, 200.0),
    ]
    merged = compare.median_metrics(rounds)
    assert merged["rounds"] == 3
    assert merged["output_throughput"] == 20.0 and merged["ttft_ms"]["median"] == 200.0
    assert compare.median_metrics([{"error": "down"}]) == {"error": "down"}


def test_interleaving_alternates_targets_within_each_level(monkeypatch, tmp_path):
    calls, seeds = [], []

    def fake_level(target, url, level, args, rnd):
        calls.append((target.name, level.concurrency))
        seeds.append((rnd, level.seed(rnd)))
        return _metrics(float(level.concurrency), 1.0)

    monkeypatch.setattr(compare, "run_level", fake_level)
    args = compare.parse_args(["--rounds", "2", "--concurrency", "1,8", "--peer", "none"])
    targets = [compare.Target("kvserve", url="http://a"), compare.Target("peer", url="http://b")]
    runs = compare.run_interleaved(targets, args, tmp_path)
    assert calls == [
        ("kvserve", 1), ("peer", 1), ("kvserve", 8), ("peer", 8),
        ("peer", 1), ("kvserve", 1), ("peer", 8), ("kvserve", 8),
    ]  # fmt: skip
    assert len(runs["kvserve"]["8"]) == 2 and len(runs["peer"]["1"]) == 2
    # both targets see the same prompts within a round; each round brings new ones
    assert seeds == [(0, 1), (0, 1), (0, 8), (0, 8), (1, 1001), (1, 1001), (1, 1008), (1, 1008)]


def test_long_prompt_levels_run_after_the_concurrency_levels(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(
        compare, "run_level", lambda t, url, level, a, rnd: calls.append((t.name, level.key)) or {}
    )
    args = compare.parse_args(["--concurrency", "1", "--long-prompts", "2048", "--peer", "none"])
    targets = [compare.Target("kvserve", url="http://a"), compare.Target("peer", url="http://b")]
    runs = compare.run_interleaved(targets, args, tmp_path)
    assert calls == [("kvserve", "1"), ("peer", "1"), ("kvserve", "long2048"), ("peer", "long2048")]
    assert set(runs["peer"]) == {"1", "long2048"}


def test_cpu_summary_names_the_flags():
    text = compare.cpu_summary()
    assert text.startswith("CPU ") and "flags:" in text and "torch CPU capability" in text


@pytest.mark.parametrize("flag", ["--rounds", "--peer-threads"])
def test_numeric_flags_parse(flag):
    args = compare.build_parser().parse_args([flag, "2"])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == 2


def test_a_peer_that_polls_when_idle_never_runs_beside_kvserve(monkeypatch, tmp_path):
    """transformers' server spins while idle: each round starts one server at a time."""
    events = []

    class FakeServer:
        def __init__(self, name, argv, port, log_dir, env):
            self.name, self.base_url = name, f"http://127.0.0.1:{port}"

        def __enter__(self):
            events.append(("start", self.name))
            return self

        def __exit__(self, *exc):
            events.append(("stop", self.name))

        def wait_healthy(self, timeout):
            return 0.0

    def fake_level(target, url, level, args, rnd):
        events.append(("run", target.name))
        return _metrics(1.0, 1.0)

    monkeypatch.setattr(compare, "ServerProcess", FakeServer)
    monkeypatch.setattr(compare, "run_level", fake_level)
    args = compare.parse_args(["--rounds", "1", "--concurrency", "1,8"])
    kv = compare.Target("kvserve", argv=["kv", "--port", "0"])
    peer = compare.Target("transformers", argv=["tf", "--port", "0"], polls_when_idle=True)
    compare.run_interleaved([kv, peer], args, tmp_path)
    assert events == [
        ("start", "kvserve"), ("run", "kvserve"), ("run", "kvserve"), ("stop", "kvserve"),
        ("start", "transformers"), ("run", "transformers"), ("run", "transformers"),
        ("stop", "transformers"),
    ]  # fmt: skip


def test_a_missing_figure_reads_n_a_never_n_ax() -> None:
    """A run without a concurrency-1 level (say `--concurrency 32`) has no ITL for the limit row."""
    from benchmarks.compare_report import StreamingLimit, format_markdown

    kv = {"32": {"output_throughput": 500.0}}
    peer = {"32": {"output_throughput": 150.0}}
    table = format_markdown([("f.gguf", kv, peer, StreamingLimit(1e8, 30.0, 160))])
    assert "n/ax" not in table
    assert "| f.gguf | ITL c=1 / streaming limit (3.33 ms) | n/a | n/a | |" in table
