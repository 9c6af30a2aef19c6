"""A sweep's search space: parsed from flags or a YAML/JSON file, checked against `TrainConfig`,
and turned into Ray Tune's `param_space`.

Spec strings (flags, or string values in a file):
  `1e-4:1e-2`          a range: log-uniform for `lr`, uniform for other floats, integers inclusive
  `log:1e-4:1e-2`      a log-uniform range for any float
  `0,30,100`           a list of values (random search samples one; grid search tries each)
File values may also be lists, or one-key mappings: `{loguniform: [a, b]}`, `{uniform: [a, b]}`,
`{randint: [a, b]}` (inclusive), `{choice: [...]}`, `{grid: [...]}`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import typing
from dataclasses import dataclass
from typing import Any, Optional

from raytrain_lm.config.checks import validate
from raytrain_lm.config.load import load_config_file
from raytrain_lm.config.settings import TrainConfig, _field_types, apply_overrides
from raytrain_lm.errors import UserError

# Settings a trial may not change: they decide where a trial runs, how big it is in resources, or
# what ASHA measures.
NOT_TUNABLE = {"preset", "data", "name", "storage", "address", "workers", "min_workers", "use_gpu",
               "cpus_per_worker", "max_steps", "log_every", "eval_every", "eval_windows",
               "checkpoint_every", "keep_checkpoints", "max_failures", "max_preemptions",
               "resize_interval", "checkpoint_upload", "schedule", "ref_batch_tokens", "ref_width",
               "peak_tflops", "model.vocab_size"}
DIST_KINDS = ("loguniform", "uniform", "randint", "choice", "grid")
LOG_BY_DEFAULT = {"lr"}  # ranges of these keys are log-uniform without saying `log:`
MAX_GRID = 10_000
DEFAULT_LR_RANGE = (0.1, 3.0)  # with no space given: lr log-uniform from a tenth to 3x the base


@dataclass
class Dim:
    key: str  # dotted TrainConfig path, e.g. "model.dropout"
    kind: str  # loguniform | uniform | randint | values
    low: Any = None
    high: Any = None
    values: Optional[list] = None

    def describe(self) -> str:
        if self.kind == "values":
            return ",".join(str(v) for v in self.values)
        prefix = "log:" if self.kind == "loguniform" else ""
        return f"{prefix}{self.low}:{self.high}"

    def to_json(self) -> dict:
        return {"key": self.key, "kind": self.kind, "low": self.low, "high": self.high,
                "values": self.values}


class SearchSpace:
    def __init__(self, dims: list[Dim], chosen: bool = False):
        self.dims = dims
        self.chosen = chosen  # the default space, picked because none was given

    def describe(self) -> str:
        return ", ".join(f"{d.key} {d.kind} {d.describe()}" for d in self.dims) + \
            (" (the default: pass --lr, --space, ... to choose)" if self.chosen else "")

    @property
    def keys(self) -> list[str]:
        return [d.key for d in self.dims]

    def grid_size(self) -> int:
        return math.prod(len(d.values) for d in self.dims)

    def to_json(self) -> list[dict]:
        return [d.to_json() for d in self.dims]

    @classmethod
    def from_json(cls, rows: list[dict]) -> "SearchSpace":
        return cls([Dim(**r) for r in rows])

    def check_searcher(self, search: str) -> None:
        if search == "grid":
            ranges = [d.key for d in self.dims if d.kind != "values"]
            if ranges:
                raise UserError(f"grid search needs lists of values, but {', '.join(ranges)} "
                                f"{'is a range' if len(ranges) == 1 else 'are ranges'}; "
                                f"give values (e.g. 1e-3,3e-3) or use --search random")
            if self.grid_size() > MAX_GRID:
                raise UserError(f"the grid has {self.grid_size():,} points (more than {MAX_GRID:,})")

    def param_space(self, search: str) -> dict[str, Any]:
        """Tune's param_space: flat dotted keys -> Tune domains."""
        from ray import tune

        out: dict[str, Any] = {}
        for d in self.dims:
            if d.kind == "values":
                out[d.key] = tune.grid_search(d.values) if search == "grid" else tune.choice(d.values)
            elif d.kind == "loguniform":
                out[d.key] = tune.loguniform(d.low, d.high)
            elif d.kind == "uniform":
                out[d.key] = tune.uniform(d.low, d.high)
            else:  # randint: ours is inclusive, Tune's upper bound is exclusive
                out[d.key] = tune.randint(d.low, d.high + 1)
        return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{'model.dropout': 0.1, 'lr': 1e-3} -> {'model': {'dropout': 0.1}, 'lr': 1e-3}"""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _field_type(cfg: TrainConfig, key: str) -> Any:
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        types_ = _field_types(node)
        if part not in types_:
            known = sorted(_tunable_keys(cfg))
            raise UserError(f"search space: unknown setting {key!r} (tunable: {', '.join(known)})")
        if i == len(parts) - 1:
            tp = types_[part]
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            return args[0] if args else tp
        node = getattr(node, part)
    raise AssertionError("unreachable")


def _tunable_keys(cfg: TrainConfig) -> list[str]:
    keys = []
    for k, tp in _field_types(cfg).items():
        if k == "model":
            keys += [f"model.{m}" for m in _field_types(cfg.model)]
        else:
            keys.append(k)
    return [k for k in keys if k not in NOT_TUNABLE]


def _number(text: Any, key: str) -> float:
    if isinstance(text, bool):
        raise UserError(f"search space: {key}: {text!r} is not a number")
    try:
        number = float(text)
    except (TypeError, ValueError):
        raise UserError(f"search space: {key}: {text!r} is not a number") from None
    if not math.isfinite(number):
        raise UserError(f"search space: {key}: {text!r} is not a finite number")
    return number


def _parse_spec(key: str, spec: Any) -> Dim:
    """One dimension from a spec string, a list, or a one-key mapping."""
    if isinstance(spec, dict):
        if len(spec) != 1 or next(iter(spec)) not in DIST_KINDS:
            raise UserError(f"search space: {key}: expected one of {', '.join(DIST_KINDS)} "
                            f"(e.g. {{loguniform: [1e-4, 1e-2]}}), got {spec!r}")
        kind, arg = next(iter(spec.items()))
        if kind in ("choice", "grid"):
            return _parse_spec(key, arg if isinstance(arg, list) else [arg])
        if not isinstance(arg, list) or len(arg) != 2:
            raise UserError(f"search space: {key}: {kind} needs [low, high], got {arg!r}")
        return Dim(key, kind, _number(arg[0], key), _number(arg[1], key))
    if isinstance(spec, list):
        if not spec:
            raise UserError(f"search space: {key}: the list of values is empty")
        return Dim(key, "values", values=list(spec))
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return Dim(key, "values", values=[spec])
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"search space: {key}: empty or invalid spec {spec!r}")
    text = spec.strip()
    if "," in text:
        values = [v.strip() for v in text.split(",")]
        if any(not v for v in values):
            raise UserError(f"search space: {key}: empty value in list {text!r}")
        return Dim(key, "values", values=values)
    if ":" in text:
        parts = text.split(":")
        kind = None
        if parts[0] in ("log", "loguniform", "uniform", "int", "randint"):
            kind = {"log": "loguniform", "int": "randint"}.get(parts[0], parts[0])
            parts = parts[1:]
        if len(parts) != 2:
            raise UserError(f"search space: {key}: a range is LOW:HIGH (or log:LOW:HIGH), got {text!r}")
        return Dim(key, kind or "auto", _number(parts[0], key), _number(parts[1], key))
    return Dim(key, "values", values=[text])


def _finish_dim(dim: Dim, cfg: TrainConfig) -> Dim:
    """Fix the range kind from the field's type; coerce and check every value and bound."""
    key = dim.key
    if key in NOT_TUNABLE:
        raise UserError(f"search space: {key} cannot be tuned (it is set for the whole sweep)")
    tp = _field_type(cfg, key)
    if dim.kind == "values":
        probe = copy.deepcopy(cfg)
        dim.values = [_coerce_value(probe, key, v) for v in dim.values]
        return dim
    if tp not in (int, float):
        raise UserError(f"search space: {key} is {tp.__name__}; give a list of values, not a range")
    if dim.kind == "auto":
        dim.kind = "randint" if tp is int else "loguniform" if key in LOG_BY_DEFAULT else "uniform"
    if tp is int:
        if dim.kind != "randint":
            raise UserError(f"search space: {key} is an integer; use LOW:HIGH or a list of values")
        if not (float(dim.low).is_integer() and float(dim.high).is_integer()):
            raise UserError(f"search space: {key} is an integer; bounds {dim.low}:{dim.high} are not")
        dim.low, dim.high = int(dim.low), int(dim.high)
    elif dim.kind == "randint":
        raise UserError(f"search space: {key} is a float; use LOW:HIGH or log:LOW:HIGH")
    if not dim.low < dim.high:
        raise UserError(f"search space: {key}: LOW must be below HIGH, got {dim.low}:{dim.high}")
    if dim.kind == "loguniform" and dim.low <= 0:
        raise UserError(f"search space: {key}: a log-uniform range needs LOW > 0, got {dim.low}")
    return dim


def _coerce_value(cfg: TrainConfig, key: str, value: Any) -> Any:
    apply_overrides(cfg, nest({key: value}), source="search space")
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def parse_space(flag_specs: dict[str, Optional[str]], space_args: list[str], space_file: Optional[str],
                base: TrainConfig) -> SearchSpace:
    """Collect dimensions from a file, `--space key=spec` and the dedicated flags (later wins)."""
    raw: dict[str, Any] = {}
    if space_file:
        raw.update(_flatten_file(load_config_file(space_file)))
    for item in space_args:
        if "=" not in item:
            raise UserError(f"--space expects key=spec, got {item!r}")
        key, spec = item.split("=", 1)
        raw[key.strip()] = spec
    raw.update({k: v for k, v in flag_specs.items() if v is not None})
    chosen = not raw
    if chosen:  # a first sweep needs no search-space lesson: the learning rate around the preset's
        raw = {"lr": f"log:{base.lr * DEFAULT_LR_RANGE[0]:.3g}:{base.lr * DEFAULT_LR_RANGE[1]:.3g}"}
    space = SearchSpace([_finish_dim(_parse_spec(k, v), base) for k, v in raw.items()], chosen)
    check_space_against_config(space, base)
    return space


def _flatten_file(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'n_layer': [2, 4]}} -> {'model.n_layer': [2, 4]}; distributions stay mappings."""
    sections = {f.name for f in dataclasses.fields(TrainConfig)  # nested configs, i.e. "model"
                if dataclasses.is_dataclass(f.default_factory)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and full in sections:
            out.update(_flatten_file(value, prefix=f"{full}."))
        else:
            out[full] = value
    return out


def check_space_against_config(space: SearchSpace, base: TrainConfig) -> None:
    """Every combination of listed values (and the ends of every range) must make a valid config,
    so a bad combination (n_embd not divisible by n_head, seq_len above the context, ...) fails
    here, in a second, rather than as a trial error minutes later."""
    choices = [d.values if d.kind == "values" else [d.low, d.high] for d in space.dims]
    if math.prod(len(c) for c in choices) > MAX_GRID:
        return
    for combo in itertools.product(*choices):
        cfg = copy.deepcopy(base)
        point = dict(zip(space.keys, combo))
        apply_overrides(cfg, nest(point), source="search space")
        try:
            validate(cfg)
        except UserError as e:
            shown = ", ".join(f"{k}={v}" for k, v in point.items())
            raise UserError(f"search space: the point {shown} is invalid: {e}") from None
