"""`kvserve serve` options: CLI > KVSERVE_* environment > YAML file > defaults, and --help shows them."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from server.cli import build_parser
from server.settings import OPTIONS, build_configs, parse_size, resolve


def _cli(argv: list[str]) -> dict[str, object]:
    args = build_parser().parse_args(["serve", *argv])
    return {k: v for k, v in vars(args).items() if k not in ("command", "version")}


def test_defaults_come_from_the_config_dataclasses() -> None:
    engine, server = build_configs(resolve({}, {}))
    assert server.port == 8000 and server.api_key is None and server.allowed_origins == ()
    assert engine.scheduler.max_num_seqs == 64 and engine.cache.enable_prefix_caching is True
    assert engine.model.model is None


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    config = tmp_path / "kvserve.yaml"
    config.write_text(
        "port: 7000\nmax-num-seqs: 3\nmax_model_len: 256\nmodel: from-file\nallowed-origins: [a, b]\n"
    )
    env = {"KVSERVE_PORT": "7100", "KVSERVE_MAX_NUM_SEQS": "5", "KVSERVE_CONFIG": str(config)}
    engine, server = build_configs(resolve(_cli(["--port", "7200"]), env))
    assert server.port == 7200  # CLI
    assert engine.scheduler.max_num_seqs == 5  # env
    assert engine.model.max_model_len == 256  # file
    assert engine.model.model == "from-file"
    assert server.allowed_origins == ("a", "b")
    engine, _ = build_configs(resolve(_cli(["my-model", "--config", str(config)]), {}))
    assert engine.model.model == "my-model" and engine.scheduler.max_num_seqs == 3


def test_every_option_has_an_env_var_with_the_naming_scheme() -> None:
    for opt in OPTIONS:
        assert opt.env == "KVSERVE_" + opt.name.upper().replace("-", "_")
    env = {
        "KVSERVE_API_KEY": "k",
        "KVSERVE_ENABLE_PREFIX_CACHING": "false",
        "KVSERVE_KV_CACHE_MEMORY": "1GiB",
        "KVSERVE_ALLOWED_ORIGINS": "http://a, http://b",
        "KVSERVE_DTYPE": "float32",
        "KVSERVE_SHUTDOWN_TIMEOUT": "2.5",
    }
    engine, server = build_configs(resolve({}, env))
    assert server.api_key == "k" and server.allowed_origins == ("http://a", "http://b")
    assert server.shutdown_timeout == 2.5
    assert engine.cache.enable_prefix_caching is False and engine.cache.kv_cache_memory == 2**30
    assert engine.model.dtype == "float32"
    engine, _ = build_configs(resolve(_cli(["--enable-prefix-caching"]), env))
    assert engine.cache.enable_prefix_caching is True


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVSERVE_PORT": "eighty"}, "KVSERVE_PORT"),
        ({"KVSERVE_DTYPE": "int3"}, "KVSERVE_DTYPE"),
        ({"KVSERVE_ENABLE_PREFIX_CACHING": "maybe"}, "KVSERVE_ENABLE_PREFIX_CACHING"),
        ({"KVSERVE_BLOCK_SIZE": "12"}, "block_size"),
        ({"KVSERVE_REASONING_PARSER": "r2"}, "KVSERVE_REASONING_PARSER.*qwen3"),
        ({"KVSERVE_CHAT_TEMPLATE_KWARGS": "[1]"}, "KVSERVE_CHAT_TEMPLATE_KWARGS.*JSON object"),
        ({"KVSERVE_CHAT_TEMPLATE_KWARGS": "{bad"}, "KVSERVE_CHAT_TEMPLATE_KWARGS.*JSON object"),
        # The server's own template variables: at start-up, not a 500 on every chat request.
        ({"KVSERVE_CHAT_TEMPLATE_KWARGS": '{"messages": 1}'}, "cannot set 'messages'"),
        ({"KVSERVE_CHAT_TEMPLATE_KWARGS": '{"a": 1, "tools": []}'}, "cannot set 'tools'"),
    ],
)
def test_bad_values_name_their_source(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_configs(resolve({}, env))


def test_reasoning_settings_from_cli_and_yaml(tmp_path: Path) -> None:
    argv = [
        "--reasoning-parser",
        "deepseek_r1",
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    ]
    _, server = build_configs(resolve(_cli(argv), {}))
    assert server.reasoning_parser == "deepseek_r1"
    assert server.chat_template_kwargs == {"enable_thinking": False}
    config = tmp_path / "c.yaml"
    config.write_text("chat-template-kwargs:\n  enable_thinking: true\n")
    _, server = build_configs(resolve({"config": str(config)}, {}))
    assert server.chat_template_kwargs == {"enable_thinking": True}
    assert server.reasoning_parser == "auto"


def test_unknown_yaml_key_is_rejected(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown option 'prot'"):
        resolve({"config": str(config)}, {})


def test_help_documents_every_flag_with_default_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for opt in OPTIONS:
        assert f"--{opt.name}" in text
        assert opt.env in text
    assert "(default: 8000; env: KVSERVE_PORT)" in text
    assert "(default: 64; env: KVSERVE_MAX_NUM_SEQS)" in text


def test_sizes() -> None:
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("2g") == 2 * 2**30
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("lots")


def test_bad_cli_value_exits_with_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--dtype", "int3"])
    assert exc.value.code == 2
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_model_as_a_flag_or_positional() -> None:
    assert resolve(_cli(["--model", "/models/a"]), {})["model"] == "/models/a"
    assert resolve(_cli(["/models/a", "--model", "/models/a"]), {})["model"] == "/models/a"
    with pytest.raises(ValueError, match="two models given"):
        resolve(_cli(["/models/a", "--model", "/models/b"]), {})


def test_target_step_ms_is_auto_by_default_and_set_by_flag_or_env() -> None:
    from engine.core.config import SchedulerConfig

    engine, _ = build_configs(resolve({}, {}))
    assert engine.scheduler.target_step_ms is None is SchedulerConfig().target_step_ms
    engine, _ = build_configs(resolve(_cli(["--target-step-ms", "auto"]), {}))
    assert engine.scheduler.target_step_ms is None
    engine, _ = build_configs(resolve(_cli(["--target-step-ms", "0"]), {}))
    assert engine.scheduler.target_step_ms == 0
    engine, _ = build_configs(resolve(_cli(["--target-step-ms", "200"]), {}))
    assert engine.scheduler.target_step_ms == 200
    engine, _ = build_configs(resolve({}, {"KVSERVE_TARGET_STEP_MS": "350"}))
    assert engine.scheduler.target_step_ms == 350
    with pytest.raises(ValueError, match="target_step_ms"):
        build_configs(resolve(_cli(["--target-step-ms", "-5"]), {}))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-offload-memory", "abc"], "expected a size such as 512MiB or 4GB, got 'abc'"),
        (["--kv-offload-memory", "-5"], "expected a size such as 512MiB or 4GB, got '-5'"),
        (["--kv-offload-disk=-1GiB"], "expected a size such as 512MiB or 4GB, got '-1GiB'"),
        (["--max-request-body-bytes", "abc"], "expected a size such as 512MiB or 4GB, got 'abc'"),
        (["--max-num-seqs", "many"], "expected an integer, got 'many'"),
        (["--max-model-len", "x"], "expected an integer, got 'x'"),
    ],
)
def test_bad_cli_values_say_what_was_expected_not_a_function_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    err = capsys.readouterr().err
    assert message in err
    assert "invalid" not in err.splitlines()[-1]  # no "invalid _optional_size value"


def _policy_in_fresh_python(env: dict[str, str], first: str = "") -> list[str]:
    """The OpenMP wait policy (server.cli logs it at start-up) in a fresh interpreter: its log line,
    then GOMP_SPINCOUNT."""
    import os
    import subprocess
    import sys

    code = (
        f"{first}\nimport os, server.cli, engine.openmp_policy as c\n"
        "print(c.set_openmp_wait_policy())\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def test_openmp_workers_spin_briefly_unless_the_user_chose() -> None:
    line, spin = _policy_in_fresh_python({})
    assert spin == "1000" and "GOMP_SPINCOUNT=1000" in line
    line, spin = _policy_in_fresh_python({"OMP_WAIT_POLICY": "ACTIVE"})
    assert spin == "None" and "OMP_WAIT_POLICY=ACTIVE (environment)" in line
    line, spin = _policy_in_fresh_python({"GOMP_SPINCOUNT": "50"})
    assert spin == "50" and "(environment)" in line
    line, spin = _policy_in_fresh_python({}, first="import torch")  # too late to change libgomp
    assert spin == "None" and "libgomp's default" in line


def test_a_port_in_use_is_named_as_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    """The server's own error line says why it cannot listen (uvicorn only exits with a code)."""
    import asyncio
    import socket

    from engine.core.config import EngineConfig
    from server.cli import serve
    from server.state import ServerConfig

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="kvserve"):
            assert asyncio.run(serve(EngineConfig(), ServerConfig(port=port))) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve"]
    assert any(f"cannot listen on 127.0.0.1:{port}" in m and "in use" in m for m in lines), lines
