"""From a compute budget to a run: the compute-optimal parameters and tokens of a scaling law
(plan/scaling_law.py), a model shape of about that many parameters, and its global batch from the
gradient noise scale when one was measured (plan/noise_scale.py). `plan --budget` prints this,
then the planner's layouts for the model.

N is the parameters of the 6N FLOPs per token (the family's matmul_params: the embeddings a
lookup reads cost no FLOPs), the same N a scaling sweep records (tune --scaling)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Callable, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan.scaling_law import CHINCHILLA, ScalingLaw

HEAD_DIM = 128  # width per head of the shapes chosen here (Llama, GPT-3 and Chinchilla's)
ASPECT = 100  # width per layer: Chinchilla 70B 8192/80 = 102, GPT-3 12288/96 = 128, Llama 2 70B 102


def load_law(spec: str) -> ScalingLaw:
    """--law: "chinchilla" (Hoffmann et al.'s published fit) or a fit's JSON (tune --scaling's
    scaling.json, whose "law" holds E, A, B, alpha, beta)."""
    if spec == "chinchilla":
        return CHINCHILLA
    path = Path(spec)
    try:
        data = json.loads(path.read_text())
        law = data.get("law", data)
        return ScalingLaw(**{k: float(law[k]) for k in ("E", "A", "B", "alpha", "beta")})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"--law {spec}: expected 'chinchilla' or a scaling fit's JSON (tune --scaling's "
                        f"scaling.json) ({type(e).__name__}: {e})") from None


def shape_for(base: ModelConfig, n_target: float, aspect: float = ASPECT) -> ModelConfig:
    """`base` with n_layer, n_embd and n_head set so that its matmul parameters come closest to
    `n_target`: heads of 64 (below 1024 wide) or 128 wide, a multiple of 8 of them from 8 up (so
    tensor parallelism up to 8 holds whole heads), the layers whatever fits the target within a
    factor 2 of `aspect` width per layer; of the shapes within 1% alike, the aspect nearest it."""
    fam = family(base)
    best, best_key = None, (math.inf, math.inf)
    for width in range(64, 64 * 1024 + 1, 64):
        heads = width // (64 if width < 1024 else HEAD_DIM)
        if width >= 1024 and width % HEAD_DIM or heads >= 8 and heads % 8:
            continue
        kv = base.n_kv_head if base.n_kv_head and heads % base.n_kv_head == 0 else None
        one, two = (fam.matmul_params(dataclasses.replace(base, n_layer=n, n_embd=width, n_head=heads,
                                                          n_kv_head=kv)) for n in (1, 2))
        if one > 2 * n_target:
            break
        layers = max(1, round((n_target - one) / (two - one)) + 1)
        if not aspect / 2 <= width / layers <= aspect * 2:
            continue
        m = dataclasses.replace(base, n_layer=layers, n_embd=width, n_head=heads, n_kv_head=kv)
        key = (round(abs(math.log(fam.matmul_params(m) / n_target)), 2), abs(math.log(width / layers / aspect)))
        if key < best_key:
            best, best_key = m, key
    if best is None:
        raise UserError(f"no model shape of about {n_target:.3g} parameters: the budget is too small "
                        f"for a transformer of this vocabulary")
    return best


@dataclasses.dataclass
class BudgetPlan:
    flops: float
    law: ScalingLaw
    n_opt: float  # the law's compute-optimal parameters
    d_opt: float  # and tokens
    model: ModelConfig  # a shape of about n_opt parameters
    n_model: int  # its matmul parameters
    tokens: float  # tokens for the budget at n_model: C / (6 n_model)
    global_batch: Optional[int]  # sequences per step, from the noise scale (None: not given)
    seq_len: int
    by_rule: bool = False  # N and D from a tokens-per-parameter rule, not the law's optimum
    gpu_hours: Optional[float] = None  # the budget as given, when in GPU-hours (flops: converted)
    flops_per_gpu_s: Optional[float] = None  # the conversion's rate: 6N FLOPs per second per GPU
    mfu: Optional[float] = None  # the planner's MFU of the layout that rate is from

    def as_dict(self) -> dict:
        return {"flops": self.flops, "law": self.law.as_dict(), "by_rule": self.by_rule,
                "n_opt": self.n_opt, "d_opt": self.d_opt, "tokens_per_param": self.d_opt / self.n_opt,
                "predicted_loss": float(self.law.loss(self.n_opt, self.d_opt)),
                "n_layer": self.model.n_layer, "n_embd": self.model.n_embd,
                "n_head": self.model.n_head, "n_model": self.n_model, "tokens": self.tokens,
                "global_batch": self.global_batch, "seq_len": self.seq_len, "steps": self.steps,
                "gpu_hours": self.gpu_hours, "flops_per_gpu_s": self.flops_per_gpu_s, "mfu": self.mfu}

    @property
    def steps(self) -> Optional[int]:
        if not self.global_batch:
            return None
        return math.ceil(self.tokens / (self.global_batch * self.seq_len))

    def text(self) -> str:
        law = self.law
        rule = (f"rule: {self.d_opt / self.n_opt:.3g} tokens per parameter" if self.by_rule else
                f"law L = {law.E:.3g} + {law.A:.4g}/N^{law.alpha:.3g} + {law.B:.4g}/D^{law.beta:.3g}")
        hours = (f" = {self.gpu_hours:.3g} GPU-hours at {self.flops_per_gpu_s / 1e12:.3g} TFLOP/s per "
                 f"GPU (6N per token at the planner's fastest layout for the model, MFU "
                 f"{self.mfu:.1%})" if self.gpu_hours else "")
        lines = [
            f"budget {self.flops:.3g} FLOPs (C = 6 N D){hours}, {rule}",
            f"compute-optimal: N = {self.n_opt:.3g} parameters, D = {self.d_opt:.3g} tokens "
            f"({self.d_opt / self.n_opt:.1f} tokens per parameter), predicted loss "
            f"{float(law.loss(self.n_opt, self.d_opt)):.4f}",
            f"model: {self.model.n_layer} layers x {self.model.n_embd} wide ({self.model.n_head} heads), "
            f"{self.n_model:.3g} parameters in matmuls; {self.tokens:.3g} tokens "
            f"({self.tokens / self.n_model:.1f} per parameter)",
        ]
        if self.global_batch:
            lines.append(f"batch: {self.global_batch} sequences of {self.seq_len} tokens per step "
                         f"(about the gradient noise scale), {self.steps:,} steps")
        return "\n".join(lines)


def budget_plan(flops: float, law: ScalingLaw, base: ModelConfig, seq_len: int,
                noise_scale: Optional[float] = None,
                tokens_per_param: Optional[float] = None) -> BudgetPlan:
    """The plan for `flops`: the law's optimum, or with `tokens_per_param` R the rule N = sqrt(C /
    6R), D = R N (Hoffmann et al.'s approaches 1 and 2 found N and D growing alike, R about 20).
    `noise_scale`: a measured B_simple in sequences (the global batch is the power of two nearest
    it: McCandlish et al.'s critical batch, where time and compute trade evenly)."""
    if not flops > 0:
        raise UserError(f"--budget must be a positive number of FLOPs (e.g. 5.8e23), got {flops}")
    if noise_scale is not None and not noise_scale > 0:
        raise UserError(f"--noise-scale must be a positive number of sequences, got {noise_scale}")
    if tokens_per_param is not None and not tokens_per_param > 0:
        raise UserError(f"--tokens-per-param must be positive, got {tokens_per_param}")
    if tokens_per_param:
        n_opt = math.sqrt(flops / (6 * tokens_per_param))
        d_opt = tokens_per_param * n_opt
    else:
        n_opt, d_opt = law.optimum(flops)
    model = shape_for(base, n_opt)
    n_model = family(model).matmul_params(model)
    batch = 2 ** round(math.log2(noise_scale)) if noise_scale else None
    return BudgetPlan(flops, law, n_opt, d_opt, model, n_model, flops / (6 * n_model), batch, seq_len,
                      by_rule=bool(tokens_per_param))


# --budget in GPU-hours: a number and one of these units, e.g. 1e6gpu-h, "2e5 GPU-hours"
GPU_HOURS = re.compile(r"^\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*(?:gpu-?h|gpu-?hours?)\s*$", re.IGNORECASE)


def parse_budget(text: str) -> tuple[float, bool]:
    """--budget: FLOPs ("5.88e23") or GPU-hours ("1e6gpu-h", "1e6 GPU-hours"); (the number,
    whether it is GPU-hours)."""
    hours = GPU_HOURS.match(text)
    try:
        value = float(hours.group(1) if hours else text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise UserError(f"--budget must be a positive number of FLOPs (e.g. 5.8e23) or of GPU-hours "
                        f"(e.g. 1e6gpu-h), got {text!r}")
    return value, bool(hours)


MFU_GUESS = 0.4  # the first iterate of gpu_hours_plan; the fixed point does not depend on it
MAX_ROUNDS = 20


def gpu_hours_plan(hours: float, rate: Callable[[BudgetPlan], tuple[float, float]],
                   peak_flops: float, **budget_args) -> BudgetPlan:
    """The plan for `hours` GPU-hours: C = hours x 3600 x the 6N FLOPs per second per GPU that
    `rate` gives for the plan's model (and its MFU), i.e. the planner's fastest layout for it. The
    model depends on C and C on the model's rate: from C at MFU_GUESS of `peak_flops`, iterated
    until the model's shape repeats (the rate depends on the shape alone, so then C is the
    fixed point: the model of C runs at the rate that spends the hours on C). `budget_args`:
    budget_plan's, but flops."""
    flops = hours * 3600 * peak_flops * MFU_GUESS
    sized = budget_plan(flops, **budget_args)
    for _ in range(MAX_ROUNDS):
        per_gpu, mfu = rate(sized)
        again = budget_plan(hours * 3600 * per_gpu, **budget_args)
        if shape(again.model) == shape(sized.model):
            sized = again
            break
        sized = again
    else:  # C at a border between two shapes: the last shape, the hours spent at its own rate
        per_gpu, mfu = rate(sized)
        sized = dataclasses.replace(sized, flops=hours * 3600 * per_gpu,
                                    tokens=hours * 3600 * per_gpu / (6 * sized.n_model))
    return dataclasses.replace(sized, gpu_hours=hours, flops_per_gpu_s=per_gpu, mfu=mfu)


def shape(m: ModelConfig) -> tuple:
    return m.n_layer, m.n_embd, m.n_head


def planner_rate(cluster, seq_len: int, batch: Callable[[BudgetPlan], int],
                 **layouts) -> Callable[[BudgetPlan], tuple[float, float]]:
    """gpu_hours_plan's rate from the planner: the 6N FLOPs per second per GPU of the fastest
    layout that fits (plan/estimate.py) for the plan's model at its global batch `batch(plan)`,
    and that layout's MFU. `layouts`: plan()'s filters (tp, pp, strategy, virtual_stages, ep)."""
    from raytrain_lm.plan.estimate import plan

    def rate(sized: BudgetPlan) -> tuple[float, float]:
        global_batch = batch(sized)
        ranked = plan(sized.model, cluster, global_batch, seq_len, **layouts)
        if not ranked[0].fits:
            raise UserError(f"no layout of {cluster.gpus} GPUs fits the compute-optimal model "
                            f"({sized.model.n_layer} layers x {sized.model.n_embd}), so no rate to "
                            f"convert GPU-hours with: add --gpus, or give --budget in FLOPs")
        per_gpu = 6 * sized.n_model * global_batch * seq_len / (ranked[0].step_s * cluster.gpus)
        return per_gpu, ranked[0].mfu
    return rate
