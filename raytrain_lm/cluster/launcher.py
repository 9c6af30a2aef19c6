"""`cluster.yaml` through Ray's own cluster launcher: validate it the way `ray up` does (schema and
fill-out of defaults, no cloud calls), then run `ray up/down/exec/dashboard`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from raytrain_lm.cluster.jobs import PROJECT
from raytrain_lm.cluster.local import ray_cli
from raytrain_lm.errors import UserError


def load_cluster_config(path: str | Path) -> dict:
    """Read and validate a cluster-launcher config like `ray up` does before any cloud call:
    Ray's JSON schema, the fill-out of the provider's defaults, the launcher's own checks."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"cluster config not found: {p} (the project's template is cluster.yaml)")
    try:
        config = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{p} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict) or not isinstance(config.get("provider"), dict) or \
            "type" not in config["provider"]:
        raise UserError(f"{p} is not a Ray cluster config (it needs a provider: type: ...)")
    import logging

    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    quiet = logging.getLogger("ray.autoscaler")  # prepare_config logs its fill-out at INFO
    level, quiet.level = quiet.level, logging.WARNING
    try:
        filled = prepare_config(config)
        validate_config(filled)
    except jsonschema.ValidationError as e:
        where = "/".join(str(x) for x in e.absolute_path) or "top level"
        raise UserError(f"{p}: {where}: {e.message}") from None
    except (ValueError, RuntimeError, KeyError, TypeError, NotImplementedError) as e:
        raise UserError(f"{p}: {' '.join(str(e).split())}") from None
    finally:
        quiet.setLevel(level)
    check_privileges(filled, p)
    return filled


def check_privileges(config: dict, path: Path) -> None:
    """On AWS, what Ray does when a config leaves them out is too open: a node type without
    SecurityGroupIds gets a group Ray creates with SSH open to 0.0.0.0/0, and a head without an
    IamInstanceProfile gets ray-autoscaler-v1 (full EC2 and S3 access) while it runs every
    job's driver. Both must be set (docs/clusters.md: "A GPU cluster in the cloud")."""
    if config["provider"].get("type") != "aws":
        return
    for name, node_type in config["available_node_types"].items():
        node = node_type.get("node_config", {})
        interfaces = node.get("NetworkInterfaces")  # EFA: the groups are the interfaces' own
        if not (node.get("SecurityGroupIds") or interfaces and all(i.get("Groups") for i in interfaces)):
            raise UserError(f"{path}: node type {name} has no SecurityGroupIds, so Ray would "
                            f"create a security group with SSH open to 0.0.0.0/0; create one "
                            f"with SSH from your network only and name it there (docs/clusters.md)")
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    if not head.get("IamInstanceProfile"):
        raise UserError(f"{path}: the head node has no IamInstanceProfile, so Ray would give it "
                        f"full EC2 and S3 access; name the head's own role (docs/clusters.md)")


LAUNCHER = {
    "up": lambda cfg, yes: ["up", cfg] + (["--yes"] if yes else []),
    "down": lambda cfg, yes: ["down", cfg] + (["--yes"] if yes else []),
    "status": lambda cfg, yes: ["exec", cfg, "ray status"],
    "dashboard": lambda cfg, yes: ["dashboard", cfg],
}


def launcher_command(action: str, config_path: str | Path, yes: bool = False) -> list[str]:
    """The `ray ...` command for `action` on a validated cluster config."""
    config = load_cluster_config(config_path)
    if action == "up":
        _ensure_token_for(config)
    return ray_cli() + LAUNCHER[action](str(config_path), yes)


def _ensure_token_for(config: dict) -> None:
    """cluster.yaml copies the laptop's token to every node: make sure there is one to copy."""
    sources = [os.path.expanduser(str(v)) for v in (config.get("file_mounts") or {}).values()]
    default = str(Path.home() / ".ray" / "auth_token")
    if default in sources and not Path(default).is_file():
        from ray._private.authentication.authentication_token_setup import generate_and_save_token

        generate_and_save_token()


def run_launcher(action: str, config_path: str | Path, yes: bool = False) -> int:
    """Run Ray's cluster launcher (`ray up/down/exec/dashboard`) from the project root, so the
    config's relative file mounts (`.` = the project) resolve; returns its exit code."""
    load_cluster_config(config_path)  # errors name the path as the user gave it
    cmd = launcher_command(action, Path(config_path).resolve(), yes)
    try:
        return subprocess.call(cmd, cwd=PROJECT)
    except KeyboardInterrupt:
        return 130
