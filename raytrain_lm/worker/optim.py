"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch

from raytrain_lm.config.layout import Layout
from raytrain_lm.config.settings import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # Decay 2-D weights (matmuls, embeddings, experts); never biases or LayerNorm gains.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0}
              for decay in (True, False) for ps in _by_placement([p for p in params if (p.dim() >= 2) == decay])]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    if Layout.of(cfg).broadcasts_params and _world() > 1:
        return ZeroOneAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def _by_placement(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` in lists of one kind each: plain tensors, and distributed tensors per device mesh.
    AdamW's foreach kernels take one kind per call, and a mixture of experts under tensor or
    expert parallelism holds several (its MoE layers whole on every tp rank, its experts on the
    ep dim)."""
    kinds: dict = {}
    for p in params:
        kinds.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(kinds.values()) or [[]]


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def owners(params: list[torch.Tensor], world: int) -> list[int]:
    """The rank that updates each parameter (ZeRO-1): largest first, each to the rank that owns
    the fewest elements so far (ties to the lower rank), so every rank holds about 1/world of
    AdamW's states. The same on every rank: it depends on the shapes only."""
    load = [0] * world
    out = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += params[i].numel()
    return out


class ZeroOneAdamW(torch.optim.AdamW):
    """ZeRO-1 over DDP (--strategy zero1): each data-parallel rank keeps AdamW's two moments for
    the whole parameters it owns (`owners`) and updates only those; after the step every owner
    broadcasts its updated parameters (one flattened tensor per owner). DDP has all-reduced the
    gradients already, so each update is the one plain AdamW makes: the same losses, step for
    step. It is an AdamW over the owned parameters to everything else (the checkpoint's
    get_state_dict, the gradient scaler), so a checkpoint holds each rank's own states under the
    parameters' names and loads at any layout; zero_grad clears every parameter's gradient."""

    def __init__(self, groups: list[dict], **kwargs):
        import torch.distributed as dist

        self.world, rank = dist.get_world_size(), dist.get_rank()
        self.all_params = [p for g in groups for p in g["params"]]
        self.owner = owners(self.all_params, self.world)
        mine = {id(p) for p, r in zip(self.all_params, self.owner) if r == rank}
        super().__init__([{**g, "params": [p for p in g["params"] if id(p) in mine]}
                          for g in groups], **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        loss = super().step(closure)
        for r in range(self.world):
            owned = [p for p, o in zip(self.all_params, self.owner) if o == r]
            if not owned:
                continue
            flat = _flatten_dense_tensors([p.data for p in owned])
            dist.broadcast(flat, src=r)
            for p, value in zip(owned, _unflatten_dense_tensors(flat, [p.data for p in owned])):
                p.data.copy_(value)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.all_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based). After a linear warmup:
    - cosine: cosine decay from lr to lr * min_lr_ratio at the horizon;
    - wsd (warmup-stable-decay): lr until the last `decay_fraction` of the horizon, then a linear
      decay to lr * min_lr_ratio at the horizon. Adding steps before the decay starts moves the
      decay without changing any learning rate already used;
    - exp_range (the LR range test of `lr-find`): from lr * min_lr_ratio up to lr, exponentially,
      over max_steps.
    The horizon is max_steps unless set; after it the minimum is held."""
    max_lr, min_lr = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "exp_range":
        return min_lr * (max_lr / min_lr) ** (min(step, cfg.max_steps - 1) / max(1, cfg.max_steps - 1))
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / (cfg.warmup_steps + 1)
    horizon = cfg.horizon or cfg.max_steps
    if step >= horizon:
        return min_lr
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup_steps, horizon - round(cfg.decay_fraction * horizon))
        if step < decay_start:
            return max_lr
        return max_lr - (max_lr - min_lr) * (step - decay_start) / max(1, horizon - decay_start)
    progress = (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def resumed_horizon(saved: TrainConfig, cfg: TrainConfig, step: int) -> TrainConfig:
    """A run resumed at `step` from a checkpoint saved with `saved` keeps the learning rates it
    has used. If --max-steps changed and moving the horizon to the new max_steps would change the
    learning rate at `step` (a cosine already decaying, a wsd already in its decay), the old
    horizon stays and the minimum is held after it; otherwise (still warming up, a wsd still
    stable) the schedule stretches to the new end. An earlier resume's horizon is inherited.
    Returns `cfg`, its horizon set."""
    if cfg.horizon is None:
        cfg.horizon = saved.horizon
    if cfg.horizon is not None or cfg.max_steps == saved.max_steps:
        return cfg  # the user's or an earlier resume's horizon, or nothing moved
    moved = lr_at(step, cfg)
    cfg.horizon = saved.max_steps
    if math.isclose(lr_at(step, cfg), moved, rel_tol=1e-12):
        cfg.horizon = None
    return cfg
