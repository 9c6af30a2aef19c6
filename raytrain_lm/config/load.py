"""A run's TrainConfig from its sources: a preset, a config file, CLI flags and `--set key=value`.

Precedence (later wins): dataclass defaults < preset < config file < CLI flags < --set; with
--init-from a Hugging Face folder, its config.json's model replaces the preset's and no later
layer may contradict it.
Every layer goes through `settings.apply_overrides`; the result is checked (checks.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.config.checks import check_model, check_resumable, validate
from raytrain_lm.config.presets import PRESETS, continued_defaults, preset_config
from raytrain_lm.config.settings import TrainConfig, apply_overrides
from raytrain_lm.errors import UserError, brief
from raytrain_lm.models import FAMILIES
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.llama.hf_llama import HF_CONFIG


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
    folder: Optional[tuple[str, dict[str, Any]]] = None,
) -> TrainConfig:
    """Layer preset < file < flags < --set into one validated TrainConfig.

    With `base` (a resumed run's saved config) the layers apply on top of it instead of a
    preset, and the model itself may not change. With `folder` ((where, the model fields of a
    Hugging Face folder's config.json): --init-from) the folder is the model: its fields replace
    the preset's (a preset given by name must agree with them; none given: the preset of the
    same model, if one is, else the default preset's training settings), and a file, flag or
    --set that contradicts one of them is refused, naming both values."""
    file_data = load_config_file(config_file) if config_file else {}
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    set_data = parse_set_args(sets or [])
    asked = preset or flags.get("preset") or set_data.get("preset") or file_data.get("preset")
    if asked is not None and not isinstance(asked, str):
        raise UserError(f"preset must be the name of one, got {brief(asked)}")
    if base is not None:
        cfg = TrainConfig.from_dict(base)
        name = cfg.preset
    elif folder is not None:
        name = asked or _preset_of(folder[1]) or "tiny"
        cfg = preset_config(name)
        if asked:
            _check_agrees(f"--preset {name}", {"arch": None, **PRESETS[name].get("model", {})},
                          cfg.model, folder)
        apply_overrides(cfg.model, folder[1], source=folder[0])
        try:  # the folder's model on its own, before any layer or anything built from it
            check_model(cfg.model)
        except UserError as e:
            raise UserError(f"{folder[0]}: its {HF_CONFIG}: {e}") from None
    else:
        name = asked or "tiny"
        cfg = preset_config(name)
        arch = _chosen_arch(file_data, flags, set_data)
        if arch is not None and arch != cfg.model.arch and arch in FAMILIES:
            apply_overrides(cfg.model, FAMILIES[arch].defaults, source=f"model.arch={arch}")
    layers = ((file_data, f"config file {config_file}"), (flags, "flags"), (set_data, "--set"))
    for data, source in layers:
        apply_overrides(cfg, data, source=source)
    if folder is not None:
        for data, source in reversed(layers):  # the last layer that sets a field is its value's
            _check_agrees(source, data.get("model") or {}, cfg.model, folder)
        if cfg.model.param != "sp":
            raise UserError(f"--param {cfg.model.param} cannot start from {folder[0]}: its weights "
                            f"were trained in the standard parametrization (sp), and mup's "
                            f"multipliers would compute another model from them; drop --param "
                            f"(the folder's parametrization is kept)")
        if base is None:  # a released model, continued: its schedule unless one is given
            given = {key for data, _ in layers for key in data}
            for key, value in continued_defaults(cfg.max_steps).items():
                if key not in given:
                    setattr(cfg, key, value)
    if base is not None:
        check_resumable(TrainConfig.from_dict(base), cfg, name)
    cfg.preset = name
    validate(cfg)
    return cfg


def _preset_of(fields: dict[str, Any]) -> Optional[str]:
    """The preset whose model is the one these fields describe, if any (its shape: the balance
    loss's weight, which the folder gives whatever the preset says, aside)."""
    for name in PRESETS:
        m = preset_config(name).model
        if all(getattr(m, k) == v for k, v in fields.items() if k != "aux_loss_coef"):
            return name
    return None


def _check_agrees(source: str, given: dict[str, Any], m: ModelConfig,
                  folder: tuple[str, dict[str, Any]]) -> None:
    """Each model field that `source` gives (now `m`'s value) is the folder's."""
    where, fields = folder
    for key in given:
        if key in fields and getattr(m, key) != fields[key]:
            said = {"flags": f"--{key.replace('_', '-')} {getattr(m, key)}",
                    "--set": f"--set model.{key}={getattr(m, key)}"}.get(
                        source, f"{source} (model.{key}={getattr(m, key)})")
            raise UserError(f"{said} contradicts {where}, whose config.json makes model.{key}="
                            f"{fields[key]}: drop it (the folder is the model)")


def _chosen_arch(*layers: dict[str, Any]) -> Optional[str]:
    """model.arch as the last layer that sets it says (None: the preset's)."""
    arch = None
    for layer in layers:
        model = layer.get("model")
        if isinstance(model, dict) and isinstance(model.get("arch"), str):  # others: refused as set
            arch = model["arch"]
    return arch
