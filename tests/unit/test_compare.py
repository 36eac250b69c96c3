"""benchmarks/compare.py without servers: the llama.cpp peer's command line, interleaving and medians."""

from __future__ import annotations

import os
import stat as statmod

import pytest

from benchmarks import compare


def _args(tmp_path, *extra):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(binary.stat().st_mode | statmod.S_IEXEC)
    args = compare.build_parser().parse_args(["--llama-server", str(binary), *extra])
    args.concurrency = [1, 8, 32]
    args.model_dir = str(tmp_path)
    args.peer = "llama.cpp"
    return args, binary


def test_llama_cpp_peer_gets_a_slot_per_concurrent_request(tmp_path):
    gguf = tmp_path / "m.gguf"
    args, binary = _args(tmp_path, "--gguf", str(gguf), "--peer-threads", "3")
    targets, peer = compare._targets(args)
    assert peer == "llama.cpp" and [t.name for t in targets] == ["kvserve", "llama.cpp"]
    argv = targets[1].argv
    assert argv[0] == str(binary) and argv[argv.index("-m") + 1] == str(gguf)
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
    argv = compare._targets(args)[0][1].argv
    gguf = argv[argv.index("-m") + 1]
    assert gguf.endswith(".gguf") and os.path.isfile(gguf)


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

    def fake_level(target, url, concurrency, args, rnd):
        calls.append((target.name, concurrency))
        seeds.append((rnd, concurrency))
        return _metrics(float(concurrency), 1.0)

    monkeypatch.setattr(compare, "run_level", fake_level)
    args = compare.build_parser().parse_args(["--rounds", "2"])
    args.concurrency = [1, 8]
    targets = [compare.Target("kvserve", url="http://a"), compare.Target("peer", url="http://b")]
    runs = compare.run_interleaved(targets, args, tmp_path)
    assert calls == [
        ("kvserve", 1), ("peer", 1), ("kvserve", 8), ("peer", 8),
        ("peer", 1), ("kvserve", 1), ("peer", 8), ("kvserve", 8),
    ]  # fmt: skip
    assert len(runs["kvserve"]["8"]) == 2 and len(runs["peer"]["1"]) == 2
    # both targets see the same prompts within a round; each round brings new ones
    assert seeds == [(0, 1), (0, 1), (0, 8), (0, 8), (1, 1), (1, 1), (1, 8), (1, 8)]


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

    def fake_level(target, url, concurrency, args, rnd):
        events.append(("run", target.name))
        return _metrics(1.0, 1.0)

    monkeypatch.setattr(compare, "ServerProcess", FakeServer)
    monkeypatch.setattr(compare, "run_level", fake_level)
    args = compare.build_parser().parse_args(["--rounds", "1"])
    args.concurrency = [1, 8]
    kv = compare.Target("kvserve", argv=["kv", "--port", "0"])
    peer = compare.Target("transformers", argv=["tf", "--port", "0"], polls_when_idle=True)
    compare.run_interleaved([kv, peer], args, tmp_path)
    assert events == [
        ("start", "kvserve"), ("run", "kvserve"), ("run", "kvserve"), ("stop", "kvserve"),
        ("start", "transformers"), ("run", "transformers"), ("run", "transformers"),
        ("stop", "transformers"),
    ]  # fmt: skip
