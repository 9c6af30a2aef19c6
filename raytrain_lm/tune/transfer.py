"""muTransfer (Tensor Programs V): a sweep of a narrow proxy under --param mup gives the settings
of the wide model. `tune --target-width N` writes, beside the best trial's config (best.yaml),
the same config at width N (transfer.yaml) for `train --config`: the learning rate, warmup,
weight decay, betas, init and every other tuned setting kept, the width set to N and the base
width kept at the proxy's, so the wide model's per-parameter learning rates, initial values and
multipliers are the proxy's rescaled by muP's rules (models/mup.py). What does not transfer (the
batch size, the training length) is the user's to set: docs/tuning.md."""

from __future__ import annotations

import copy
from typing import Any, Optional

from raytrain_lm.config.checks import check_model
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import UserError
from raytrain_lm.models import mup

SEARCHED_WIDTHS = ("model.n_embd", "model.head_size", "model.ffn_dim", "model.shared_ffn_dim",
                   "model.mup_base_width", "model.param")


def check_target(cfg: TrainConfig, width: Optional[int], searched: list[str]) -> None:
    """--target-width fits the sweep: a mup proxy of a fixed shape, and a target that is a valid
    model (one UserError line each)."""
    if width is None:
        return
    if cfg.model.param != "mup":
        raise UserError(f"--target-width {width} transfers the proxy's settings to another width "
                        f"only under --param mup (under sp the best lr moves with the width)")
    shaped = [k for k in searched if k in SEARCHED_WIDTHS]
    if shaped:
        raise UserError(f"--target-width transfers one proxy shape: do not search {', '.join(shaped)}")
    check_model(TrainConfig.from_dict(target_model(cfg.to_dict(), width)).model)


def target_model(trial_cfg: dict[str, Any], width: int) -> dict[str, Any]:
    """`trial_cfg` (a proxy's full config, as saved) at width `width`: the base width kept at the
    proxy's, the sizes that follow the width (head size, ffn sizes, where set) scaled with it."""
    out = copy.deepcopy(trial_cfg)
    m = out["model"]
    proxy = m["n_embd"]
    m["mup_base_width"] = m.get("mup_base_width") or proxy
    for key in mup.WIDTH_SIZES:
        if m.get(key):
            if (m[key] * width) % proxy:
                raise UserError(f"--target-width {width}: model.{key} ({m[key]}) x {width} is not "
                                f"divisible by the proxy's width {proxy}; choose a multiple")
            m[key] = m[key] * width // proxy
    m["n_embd"] = width
    return out


def transfer_yaml(trial_cfg: dict[str, Any], width: int, sweep: str, trial: str) -> str:
    """transfer.yaml: the best trial's config at the target width, for `train --config`."""
    import yaml

    cfg = {k: v for k, v in target_model(trial_cfg, width).items()
           if k not in ("name", "storage", "address")}
    head = (f"# muTransfer of sweep {sweep}'s best trial {trial} (width "
            f"{trial_cfg['model']['n_embd']}, --param mup) to width {width}\n"
            f"# use: python cli.py train --config transfer.yaml --max-steps N  (the batch size and "
            f"the training length do not transfer: docs/tuning.md)\n")
    return head + yaml.safe_dump(cfg, sort_keys=False)
