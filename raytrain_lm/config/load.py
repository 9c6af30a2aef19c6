"""A run's TrainConfig from its sources: a preset, a config file, CLI flags and `--set key=value`.

Precedence (later wins): dataclass defaults < preset < config file < CLI flags < --set.
Every layer goes through `settings.apply_overrides`; the result is checked (checks.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.config.checks import check_resumable, validate
from raytrain_lm.config.presets import preset_config
from raytrain_lm.config.settings import TrainConfig, apply_overrides
from raytrain_lm.errors import UserError
from raytrain_lm.models import FAMILIES


def parse_set_args(items: list[str]) -> dict[str, Any]:
    """['model.n_layer=6', 'lr=1e-3'] -> {'model': {'n_layer': '6'}, 'lr': '1e-3'} (coerced later)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"--set: {key!r} conflicts with another --set")
        node[parts[-1]] = value.strip()
    return out


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON config file into a dict (validated when applied)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file {p} is a folder, not a file")
    if not p.is_file():
        raise UserError(f"config file not found: {p}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {p}: {getattr(e, 'strerror', None) or e}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise UserError(f"config file {p}: use .yaml, .yml, .toml or .json")
    except UserError:
        raise
    except Exception as e:  # parse errors of any of the three formats
        raise UserError(f"config file {p} could not be parsed: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {p} must hold a mapping of settings")
    return data


def build_config(
    preset: Optional[str] = None,
    config_file: Optional[str] = None,
    flags: Optional[dict[str, Any]] = None,
    sets: Optional[list[str]] = None,
    base: Optional[dict[str, Any]] = None,
) -> TrainConfig:
    """Layer preset < file < flags < --set into one validated TrainConfig.

    With `base` (a resumed run's saved config) the layers apply on top of it instead of a
    preset, and the model itself may not change."""
    file_data = load_config_file(config_file) if config_file else {}
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    set_data = parse_set_args(sets or [])
    if base is not None:
        cfg = TrainConfig.from_dict(base)
        name = cfg.preset
    else:
        name = (preset or flags.get("preset") or set_data.get("preset") or file_data.get("preset")
                or "tiny")
        cfg = preset_config(name)
        arch = _chosen_arch(file_data, flags, set_data)
        if arch is not None and arch != cfg.model.arch and arch in FAMILIES:
            apply_overrides(cfg.model, FAMILIES[arch].defaults, source=f"model.arch={arch}")
    apply_overrides(cfg, file_data, source=f"config file {config_file}")
    apply_overrides(cfg, flags, source="flags")
    apply_overrides(cfg, set_data, source="--set")
    if base is not None:
        check_resumable(TrainConfig.from_dict(base), cfg, name)
    cfg.preset = name
    validate(cfg)
    return cfg


def _chosen_arch(*layers: dict[str, Any]) -> Optional[str]:
    """model.arch as the last layer that sets it says (None: the preset's)."""
    arch = None
    for layer in layers:
        model = layer.get("model")
        if isinstance(model, dict) and model.get("arch") is not None:
            arch = model["arch"]
    return arch
