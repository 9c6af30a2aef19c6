"""The maximal update parametrization (muP; Yang et al., Tensor Programs V, arXiv:2203.03466,
Table 3 for Adam; Microsoft's `mup` package is the reference), for every family on the decoder
skeleton. Torch-free to import (the checks run on the driver): the rules are a function of the
config and a parameter's *name*, never of a tensor's shape after sharding, so FSDP2, ZeRO,
tensor-parallel shards, pipeline stages and a resumed run all put each parameter in the same
group.

The base shape is the model's own config with `n_embd` = `model.mup_base_width`: same depth,
same heads (n_head, n_kv_head), and every size that follows the width follows it (the head size,
an explicit ffn_dim or shared_ffn_dim: scaled by base/width). At the base width mup is sp.

A parameter's dims that differ from the base model's are its "infinite" dims (as `mup`'s
infshape):
- two (hidden matrices: q/k/v/o, the MLP's, the experts'): Adam lr x 1/m and init std x
  1/sqrt(m) (variance 1/fan_in), m = fan_in / base fan_in (the width multiplier); AdamW's
  weight decay x m, so the decay per step (torch multiplies it by the lr) is width-independent,
  as `mup.MuAdamW` (decoupled_wd=False) does;
- one (embeddings, biases, norm gains, the output head): lr and init unchanged;
- a readout other than the output head (a router: width -> experts), whose 1/m multiplier has no
  norm to be folded into: muP's multiplier-free form (Table 3's output weights), init std x 1/m
  and Adam lr x 1/m (under Adam the same training as `mup.MuReadout`'s x/m at a constant
  init), weight decay x m (lr x wd kept); without it the router's logits grow ~m after the first
  Adam step, as an sp model's output logits;
- the output logits x base/width. Folded into the final norm's gain (and bias): its initial
  value and its Adam lr x base/width, which under Adam is the same training as the multiplier
  on the logits (Adam's update does not depend on the gradient's scale) at no cost per step;
  an untied or tied head alike;
- attention logits q.k x sqrt(d_base)/d instead of 1/sqrt(d) (1/d, equal to sp at the base):
  SDPA's own `scale`, no cost per step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import ModelConfig

PARAMS = ("sp", "mup")
# Modules that wrap another and add a step to its parameters' names (DDP, torch.compile,
# activation checkpointing, FSDP1): a parameter's role is its name without them.
WRAPPERS = re.compile(r"(^|\.)(module|_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
# Sizes that follow the width (scaled by base/width in the base shape) where set explicitly.
WIDTH_SIZES = ("head_size", "ffn_dim", "shared_ffn_dim")
OUTPUT_SCALED = ("ln_f.weight", "ln_f.bias")  # the folded output multiplier's home
# Readouts other than the output head: matrices from the width to a fixed size (a mixture of
# experts' router), by the last steps of their names. An embedding's shape is the same (a fixed
# size by the width), so the shape alone cannot tell them.
READOUTS = ("router.weight",)


@dataclass(frozen=True)
class Rule:
    """How one parameter scales: its Adam lr, AdamW weight decay and initial std, each as a
    multiple of the base model's (sp's) value; `kind` matrix, vector, output (the final norm,
    which carries the output multiplier) or readout (a router)."""
    kind: str
    lr: float = 1.0
    wd: float = 1.0
    init: float = 1.0


SP = Rule("sp")


def base_width(m: ModelConfig) -> int:
    return m.mup_base_width or m.n_embd


def base_config(m: ModelConfig) -> ModelConfig:
    """The base shape: `m` at width base_width(m) (see the module docstring)."""
    base = base_width(m)
    sizes = {k: getattr(m, k) * base // m.n_embd for k in WIDTH_SIZES if getattr(m, k)}
    return dataclasses.replace(m, n_embd=base, **sizes)


def check(m: ModelConfig) -> None:
    """model.param and the base shape: one UserError line each (torch-free: a driver check)."""
    if m.param not in PARAMS:
        raise UserError(f"model.param must be one of {', '.join(PARAMS)}, got {m.param!r}")
    if m.param == "sp":
        for key in ("mup_base_width", "mup_zero_init"):
            if getattr(m, key):
                raise UserError(f"model.{key} is a setting of --param mup: drop it or add "
                                f"--param mup")
        return
    base = base_width(m)
    if base < 1 or base % m.n_head:
        raise UserError(f"model.mup_base_width ({base}) must be a positive multiple of "
                        f"model.n_head ({m.n_head}): the base model has the same heads")
    for k in WIDTH_SIZES:
        value = getattr(m, k)
        if value and (value * base) % m.n_embd:
            raise UserError(f"model.{k} ({value}) x mup_base_width ({base}) must be divisible by "
                            f"model.n_embd ({m.n_embd}): the base model's {k} follows the width")
    b = base_config(m)
    if base != m.n_embd and m.hidden_dim == b.hidden_dim:
        raise UserError(f"model.param mup: the MLP's hidden size ({m.hidden_dim}) does not follow "
                        f"the width (the base's is the same at width {base}); set "
                        f"model.multiple_of below it, or model.ffn_dim")


def attention_scale(m: ModelConfig) -> Optional[float]:
    """SDPA's scale of q.k: None (its default 1/sqrt(d)) under sp, sqrt(d_base)/d under mup."""
    if m.param != "mup":
        return None
    return math.sqrt(base_config(m).head_dim) / m.head_dim


def output_multiplier(m: ModelConfig) -> float:
    """What the output logits are multiplied by: base/width under mup, 1 under sp."""
    return base_width(m) / m.n_embd if m.param == "mup" else 1.0


def role(name: str) -> str:
    """A parameter's name as the decoder names it: without the wrappers' steps (WRAPPERS)."""
    return WRAPPERS.sub(r"\1", name)


def rule(m: ModelConfig, name: str) -> Rule:
    """The rule of the parameter `name` (any wrapper's or pipeline stage's name of it) under
    `m`'s parametrization. A name the model does not have is an error: a group must never be
    guessed."""
    if m.param != "mup":
        return SP
    rules = _rules(_key(m))
    found = rules.get(role(name))
    if found is None:
        raise KeyError(f"no muP rule for parameter {name!r} of a {m.arch}")
    return found


def rules(m: ModelConfig) -> dict[str, Rule]:
    """Every parameter's rule, by name (tied ones once, by their first owner's name, and again
    under the tied name: lm_head.weight of a tied head is wte.weight)."""
    return dict(_rules(_key(m)))


def _key(m: ModelConfig) -> tuple:
    return tuple(sorted(dataclasses.asdict(m).items()))


@lru_cache(maxsize=64)
def _rules(key: tuple) -> dict[str, Rule]:
    m = ModelConfig(**dict(key))
    shapes, base = _shapes(m), _shapes(base_config(m))
    out_mult = output_multiplier(m)
    rules = {}
    for name, shape in shapes.items():
        inf = [i for i, (a, b) in enumerate(zip(shape, base[name])) if a != b]
        if name in OUTPUT_SCALED:
            rules[name] = Rule("output", lr=out_mult, init=out_mult)
        elif name.endswith(READOUTS) and inf:
            rules[name] = Rule("readout", lr=out_mult, wd=1 / out_mult, init=out_mult)
        elif len(inf) >= 2:
            mult = shape[-1] / base[name][-1]  # fan_in: a Linear's (out, in), experts' (n, out, in)
            rules[name] = Rule("matrix", lr=1 / mult, wd=mult, init=1 / math.sqrt(mult))
        else:
            rules[name] = Rule("vector")
    return rules


def _shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, by name (a meta-device build: no memory, milliseconds)."""
    import torch  # torch: only where a model is built (the worker): the checks above stay torch-free
    from torch.overrides import TorchFunctionMode  # torch: as above

    from raytrain_lm.models import build_model

    class NoDraws(TorchFunctionMode):
        """Modules' own init drawing on the meta device is skipped: its first normal_ imports
        torch's Python decompositions (~7 s), for values a meta tensor does not hold."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) == "normal_":  # Tensor.normal_, init.normal_
                return args[0] if args else kwargs["tensor"]
            return func(*args, **(kwargs or {}))

    with torch.device("meta"), NoDraws():
        model = build_model(dataclasses.replace(m, vocab_size=m.vocab_size or 256))
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def init_spec(m: ModelConfig, name: str, spec: tuple) -> tuple:
    """The family's sp initialisation `spec` of parameter `name`, under `m`'s parametrization:
    a normal's std x the rule's init; the final norm's gain (ones) filled with the output
    multiplier, its bias (zeros) left at zero. With model.mup_zero_init the queries and an
    untied head start at zero (`zero_init_spec`)."""
    r = rule(m, name)
    zero = zero_init_spec(m, name)
    if zero is not None:
        return zero if zero[0] == "zeros" else (zero[0], spec[1] * r.init, *zero[2:])
    kind, std = spec
    if kind == "normal":
        return kind, std * r.init
    if kind == "ones" and r.init != 1.0:
        return "fill", r.init
    return spec


# The query projections under model.mup_zero_init: a separate one zeroed whole, GPT's fused
# c_attn by its query rows (head-interleaved: [h0 q, h0 k, h0 v, h1 q, ...], head_dim each).
QUERIES = ("q_proj.weight", "q_proj.bias")
FUSED_QKV = "c_attn.weight"


def zero_init_spec(m: ModelConfig, name: str) -> Optional[tuple]:
    """Under mup with model.mup_zero_init: ("zeros", 0) for a query projection and an untied
    output head (a tied one is initialised as the embedding, under its name), ("normal_zero_q",
    std, head_dim) for a fused qkv (the caller's std; its query rows zero); else None. At init
    the attention is then uniform and the logits zero: the two coordinates that shrink with the
    width at init under muP (`mup`'s README) start at their limit."""
    if m.param != "mup" or not m.mup_zero_init:
        return None
    n = role(name)
    if n.endswith(QUERIES) or n == "lm_head.weight":
        return ("zeros", 0.0)
    if n.endswith(FUSED_QKV):
        return ("normal_zero_q", None, m.head_dim)
    return None
