"""The `ray up` configs in deploy/ pass Ray's own validator and say what the docs promise.

Ray's validator runs offline: `prepare_config` only merges the provider's defaults.yaml (and, for
the local provider, fills the node type from head_ip / worker_ips). The AWS-specific bootstrap
(`ray up` resolving subnets, AMIs, IAM roles and security groups) needs AWS credentials and the
network, so it cannot run here; what it would read (instance types, ports) is checked below.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from serving.settings.config import Settings

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "deploy").glob("*.yaml"))
DOCS = ROOT / "docs" / "deploy.md"

# Instance types with exactly one GPU; a shard actor asks for one GPU, so one stage per node.
ONE_GPU_INSTANCE_TYPES = {"g4dn.xlarge", "g5.xlarge", "g5.2xlarge", "g6.xlarge", "g6.2xlarge"}
# What clients may reach: HTTP and gRPC. Ray's ports (GCS, dashboard and job API, Ray client,
# object manager) run code for whoever reaches them: between the cluster's nodes only.
SERVING_PORTS = {8000, 8001}
RAY_PORTS = {6379, 8265, 10001, 8076}
TOKEN_PATH = "~/.ray/auth_token"  # Ray's default token path: every process finds it there
CLI_ONLY_FLAGS = {"help", "config"}


def _load(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), f"{path.name} must hold a mapping, got {type(loaded)}"
    return loaded


def _prepared(path: Path) -> dict[str, Any]:
    return prepare_config(copy.deepcopy(_load(path)))


def _all_commands(cfg: dict[str, Any]) -> list[str]:
    keys = [k for k in cfg if k.endswith("_commands")]
    return [cmd for key in keys for cmd in cfg[key]]


def test_deploy_has_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"aws-gpu.yaml", "onprem.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_passes_rays_validator(path: Path) -> None:
    validate_config(_prepared(path))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_installs_no_other_ray(path: Path) -> None:
    # Ray's AWS defaults pip-install a Ray nightly wheel unless setup_commands is overridden;
    # every node must run the image's pinned Ray instead.
    installs = [c for c in _all_commands(_prepared(path)) if "pip install" in c]
    assert installs == [], f"{path.name} installs packages at node start: {installs}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_runs_the_project_image_at_its_version(path: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    image = _load(path)["docker"]["image"]
    name, _, tag = image.rpartition(":")
    assert name.endswith("/shardserve"), f"{path.name}: image {image!r} is not shardserve's"
    assert tag == version, f"{path.name}: image tag {tag!r}; expected the package's {version!r}"


def test_validator_rejects_fractional_resources() -> None:
    cfg = _load(ROOT / "deploy" / "aws-gpu.yaml")
    cfg["available_node_types"]["gpu.g5"]["resources"]["GPU"] = 0.5
    with pytest.raises(jsonschema.ValidationError, match=r"0\.5"):
        validate_config(prepare_config(cfg))


def test_aws_head_is_cpu_and_workers_have_one_gpu_each() -> None:
    cfg = _prepared(ROOT / "deploy" / "aws-gpu.yaml")
    types = cfg["available_node_types"]
    head = types.pop(cfg["head_node_type"])
    assert head["resources"].get("GPU", 0) == 0
    assert types, "aws-gpu.yaml has no worker node types"
    for name, node_type in types.items():
        instance = node_type["node_config"]["InstanceType"]
        assert instance in ONE_GPU_INSTANCE_TYPES, f"{name}: {instance!r} is not a 1-GPU type"
        assert node_type["resources"]["GPU"] == 1, f"{name}: {node_type['resources']}"
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"] <= cfg["max_workers"]


def test_aws_security_group_opens_only_the_serving_ports_to_clients() -> None:
    rules = _load(ROOT / "deploy" / "aws-gpu.yaml")["provider"]["security_group"]["IpPermissions"]
    ranges = {(r["FromPort"], r["ToPort"]) for r in rules}
    assert ranges == {(port, port) for port in SERVING_PORTS}, f"opened to clients: {ranges}"
    world = [r["FromPort"] for r in rules if {"CidrIp": "0.0.0.0/0"} in r.get("IpRanges", [])]
    assert world == [], f"open to 0.0.0.0/0: {world}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_head_starts_ray_on_the_documented_ports(path: Path) -> None:
    head_start = " ".join(_prepared(path)["head_start_ray_commands"])
    assert "--port=6379" in head_start
    assert "--ray-client-server-port=10001" in head_start


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_dashboard_listens_on_the_heads_localhost_only(path: Path) -> None:
    # Reached through `ray dashboard CONFIG` (an ssh tunnel), never from the network.
    head_start = " ".join(_prepared(path)["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    anywhere = [c for c in _all_commands(_prepared(path)) if "0.0.0.0" in c]
    assert anywhere == [], f"{path.name} binds something to every address: {anywhere}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_ray_start_uses_token_authentication(path: Path) -> None:
    cfg = _prepared(path)
    starts = [
        c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in cfg[key]
    ]
    ray_starts = [c for c in starts if "ray start" in c]
    assert len(ray_starts) == 2, starts
    for command in ray_starts:
        before = command.split("ray start")[0]
        assert "export RAY_AUTH_MODE=token;" in before, f"{path.name}: {command!r}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_token_reaches_every_node_and_every_process_there(path: Path) -> None:
    cfg = _prepared(path)
    # file_mounts go to every node, workers included; at Ray's default path, so `ray exec`,
    # job drivers (shardserve serve) and the autoscaler find it with no further setting.
    assert cfg["file_mounts"].get(TOKEN_PATH) == TOKEN_PATH, cfg["file_mounts"]
    assert "--env RAY_AUTH_MODE=token" in cfg["docker"]["run_options"]
    # A token in the config itself would end up in version control and in every node's logs.
    text = path.read_text()
    assert "RAY_AUTH_TOKEN=" not in text


def test_onprem_names_only_the_serving_ports_for_clients() -> None:
    header = (ROOT / "deploy" / "onprem.yaml").read_text().split("cluster_name:")[0]
    assert "8265 (dashboard)" not in header and "10001 (Ray client)" not in header
    assert "8000 (HTTP)" in header and "8001" in header


def test_onprem_uses_the_machines_listed() -> None:
    raw = _load(ROOT / "deploy" / "onprem.yaml")
    assert raw["provider"]["type"] == "local"
    assert raw["provider"]["head_ip"] not in raw["provider"]["worker_ips"]
    workers = next(
        iter(_prepared(ROOT / "deploy" / "onprem.yaml")["available_node_types"].values())
    )
    assert workers["min_workers"] == workers["max_workers"] == len(raw["provider"]["worker_ips"])


def test_docs_name_only_existing_configs() -> None:
    named = set(re.findall(r"deploy/[\w.-]+\.yaml", DOCS.read_text()))
    assert named, "docs/deploy.md names no cluster config"
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert missing == [], f"docs/deploy.md names configs that do not exist: {missing}"


def _serve_flags(text: str) -> set[str]:
    """Flags of every `shardserve serve` command in the text, continuation lines included."""
    flags: set[str] = set()
    for line in text.replace("\\\n", " ").splitlines():
        head, sep, rest = line.partition("shardserve serve")
        if not sep:
            continue
        if head.endswith(("'", '"')):
            # Quoted for `ray exec`: flags after the closing quote belong to ray, not shardserve.
            rest = rest.split(head[-1])[0]
        flags |= set(re.findall(r"--([a-z][a-z-]+)", rest))
    return flags


def test_docs_serve_flags_are_settings() -> None:
    flags = _serve_flags(DOCS.read_text())
    assert {"ray-address", "host", "stages"} <= flags, f"docs show only {sorted(flags)}"
    known = set(Settings.model_fields)
    unknown = sorted(f for f in flags - CLI_ONLY_FLAGS if f.replace("-", "_") not in known)
    assert unknown == [], f"docs use flags that are not settings: {unknown}"


def test_docs_keep_ray_closed_and_the_admin_token_off_command_lines() -> None:
    text = DOCS.read_text().replace("\\\n", " ")
    assert "--dashboard-host=0.0.0.0" not in text
    assert "8265 / 10001 if wanted" not in text
    # A token on a command line is in the shell history, `ps` and the Ray job's record.
    flags = re.findall(r"--admin-token(?:=|\s+)(\S+)", text)
    assert flags == [], f"docs/deploy.md passes the admin token on a command line: {flags}"
    assert "SHARDSERVE_ADMIN_TOKEN=" not in text
    submits = [line for line in text.splitlines() if "ray job submit --" in line]
    assert submits, "docs/deploy.md shows no ray job submit"
    for line in submits:
        assert "RAY_AUTH_MODE=token" in line, f"a job submit without the Ray token: {line}"
    assert "--admin-token-file" in text
    assert "RAY_AUTH_MODE=token ray get-auth-token --generate" in text
