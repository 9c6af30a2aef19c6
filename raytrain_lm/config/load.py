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
from raytrain_lm.errors import UserError, brief
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


# A config file of settings is a few KB; one of 1 MiB is no config file.
MAX_CONFIG_BYTES = 1 << 20


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON config file into a dict (validated when applied)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file {p} is a folder, not a file")
    if not p.is_file():
        raise UserError(f"config file not found: {p}")
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise UserError(f"config file {p} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a "
                            f"file of settings")
        text = raw.decode()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {p}: {getattr(e, 'strerror', None) or e}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            data = _load_yaml(text, p) or {}
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


def _load_yaml(text: str, path: Path) -> Any:
    """yaml.safe_load without aliases: settings are plain values, and an alias (`*name`) lets a
    file of a few hundred bytes stand for 10^9 strings (an "alias bomb"), cheap to parse and
    endless to walk. Anchors alone are harmless."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise UserError(f"config file {path}, line {mark.line + 1}: aliases (*{self.peek_event().anchor}) are "
                                f"not allowed in a config file; write the values out")
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=NoAliases)


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
        if not isinstance(name, str):
            raise UserError(f"preset must be the name of one, got {brief(name)}")
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
        if isinstance(model, dict) and isinstance(model.get("arch"), str):  # others: refused as set
            arch = model["arch"]
    return arch
