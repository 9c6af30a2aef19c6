"""The squared norm of a gradient at a smaller batch than the step's, for the gradient noise
scale (plan/noise_scale.py): scalars per rank per step, carried in the rows' existing all-gather
(worker/metrics.Meter sums them over the ranks), with no collective of their own (but for
context parallelism on FSDP2: below).

Each rank adds up the squares of its part of its data-parallel rank's gradient before the
data-parallel reduction, weighted so that the sum over every rank is the sum over the dp ranks of
each one's whole gradient (b = one dp rank's batch, B = the global batch):

- DDP (nn.parallel.DistributedDataParallel, Ray's prepare_model): a comm hook sums the squares of
  each bucket before its all-reduce.
- FSDP2 (zero1, zero2, fsdp) and FSDP2's `replicate` (ddp with tp or pp), with or without tensor
  or pipeline parallelism: each parameter group's post-backward, before it reduce-scatters or
  all-reduces, reads the unsharded gradients this rank computed (after the step's micro-batches:
  gradient sync happens on the last one). With tp a rank holds its tp shard of each gradient:
  the tp ranks' squares add up to the dp rank's, and a gradient every tp rank holds whole
  (Replicate, or no DTensor over tp) counts 1/tp on each. With pp each stage adds its own
  parameters'; the schedule has summed the microbatches' gradients (it divides by their number
  after the reduction), so its squares are divided by microbatches^2.
- One dp rank with accumulation (dp 1, with or without tp or cp): the gradient after the step's
  first micro-batch (b = a micro-batch, B = the step).

Context parallelism (--cp): each cp rank's gradient is the gradient of its share of the dp rank's
tokens (its mean loss), the dp rank's the mean of the cp ranks' -- the square of a sum, whose cp
cross terms no rank holds. The cp ranks' parts are summed before squaring, exactly:
- DDP: the comm hook does the all-reduce over dp x cp as a reduce-scatter over cp, an all-reduce
  of the shard over dp and an all-gather over cp, squaring its shard of the cp sum in between.
  The same bytes per rank as the one all-reduce it replaces (2N(dp cp - 1)/(dp cp), the 2-D
  ring), and the same result; two more collectives' latency per bucket.
- FSDP2 (and the one-dp-rank micro-batch): the gradients about to be reduced (the first
  micro-batch's) are copied into one buffer and reduce-scattered over cp, each rank squaring its
  shard of the sum: one extra reduce-scatter over cp per step of the gradient's size, N(cp-1)/cp
  bytes per rank beside FSDP's own N(dp cp - 1)/(dp cp), and a copy of the gradient's size
  while it runs. Folding the square into FSDP2's own reduce-scatter (over cp first, then dp, as
  DDP's hook does) would cost nothing extra but means replacing FSDP2's reduction. An extra
  reduction on every k-th step only would cost a k-th as much but feed the moving averages one
  step in k: k times the steps before the estimate settles (its time constant, 20 samples at
  decay 0.95, counts samples, not steps), for a cost within this machine's noise at k = 1
  (docs/benchmarks.md, noise scale under cp).

Parameters whose local gradient is not one dp rank's, left out of both |G_b|^2 and |G_B|^2
(`excluded`: their share of the step's squared norm is subtracted from the clipping norm's):
- the pipeline's tied embedding: its dp rank's gradient is the sum of the first and the last
  stage's parts (pp.sync_tied_grads, after the dp reduction); the square of a sum spread over two
  ranks needs a collective of its own;
- the routed experts where ep = dp (edp 1): their gradient before the reduction over edp is
  already the global batch's (parallel/ep.py): no smaller batch for them across ranks. (With
  accumulation their first micro-batch's gradient, ep x a micro-batch, would be one; not read:
  the micro-batch's squares are taken on one dp rank's layouts only.) The estimate is then the
  dense parameters' |G|^2 and tr(Sigma) alone: B_simple of that subset of the parameters.

The routed experts with expert parallelism over edp > 1: their gradient before the edp reduction
is the mean over the ep group's batches (ep x b sequences, ep ranks each holding its experts' whole
gradient), a third batch size. |G|^2 and tr(Sigma) are sums over parameters and appendix A's
estimators are linear in the two squared norms, so each parameter set is estimated at its own
(b, B) and the estimates added (worker/metrics.Meter): the experts' squares before the edp
reduction are a second pair (`sq_experts`, b_experts = ep x b), beside their share of the step's
squared norm (their |G_B|^2, taken out of the dense parameters'). `batches` is then (b, B,
b_experts).

No estimate (None) for a pipeline on one dp rank (its microbatches are summed inside the
schedule) and for one dp rank without accumulation.

No `from __future__ import annotations` here: DDP checks the comm hook's annotations as objects."""

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from raytrain_lm.parallel.mesh import ALL_GATHER, REDUCE_SCATTER


class SmallBatchNorm:
    """This rank's squared gradient norm at the small batch, for one step. `batches`: (b, B) in
    sequences, or None where the layout gives no small batch (then `take` returns None)."""

    def __init__(self, built, micro_batch: int, accum: int, device: torch.device):
        """`built`: parallel.Built, the model as this rank holds it. `micro_batch`, `accum`: the
        run's --batch-size and --grad-accum (with pp: the dp rank's sequences per step, 1)."""
        self.accum, self.device = accum, device
        self.sq: Optional[torch.Tensor] = None
        self.sq_experts: Optional[torch.Tensor] = None
        self.batches: Optional[tuple] = None
        self.micro = False
        lay, dp = built.layout, built.dp
        self.tp = lay.tp if built.tp_on else 1
        self.params = built.params()
        # fp32 sums (float64 for a float64 model: a reference run)
        self.dtype = _at_least_fp32(self.params[0]) if self.params else torch.float32
        # context parallelism: each rank's gradient is a part of its dp rank's (see above)
        self.cp, self.cp_group = lay.cp, built.cp_group
        # the routed experts under ep, measured at their own batch where edp > 1 (see above)
        self.experts = _experts(built) if 1 < lay.ep < dp else set()
        self.excluded = _excluded(built)
        # the pipeline's gradients at the reduction: the sum over its microbatches (see above)
        self.factor = 1.0 / lay.microbatches ** 2 if built.pp_on else 1.0
        ddp, groups = _ddp_of(built.modules[0]), _fsdp_groups(built)
        if built.replicated and dp > 1 and ddp is not None:
            if lay.cp > 1:
                self.dp_group = built.mesh["dp"].get_group()
                ddp.register_comm_hook(self, _squares_over_cp_then_allreduce)
            else:
                ddp.register_comm_hook(self, _squares_then_allreduce)
            self.batches = (micro_batch * accum, micro_batch * accum * dp)
        elif groups and dp > 1:
            for group in groups:
                _squares_before_reduce(group, self)
            self.batches = (micro_batch * accum, micro_batch * accum * dp)
            if self.experts:
                self.batches += (micro_batch * accum * lay.ep,)
        elif dp == 1 and accum > 1 and not built.pp_on and not groups:
            self.micro = True
            self.batches = (micro_batch, micro_batch * accum)

    def start(self) -> None:
        """Before a step's first backward."""
        if self.batches is not None:
            self.sq = torch.zeros((), dtype=self.dtype, device=self.device)
            self.sq_experts = torch.zeros((), dtype=self.dtype, device=self.device)

    def after_micro(self, micro: int, params) -> None:
        """After micro-batch `micro`'s backward: the first one's gradient (loss / accum), scaled
        back to that micro-batch's mean gradient. Under tp a gradient still pending its tp
        reduction (Partial, sequence parallelism) is reduced into a copy (p.grad stays as
        autograd accumulates it)."""
        if not (self.micro and micro == 0):
            return
        parts = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                if tuple(g.placements) != tuple(p.placements):
                    g = g.redistribute(p.device_mesh, p.placements)
                parts.append((g.to_local(), _tp_copies(p._spec, self.tp)))
            else:
                parts.append((g, _tp_copies(None, self.tp)))
        if parts:
            self.sq = self._squares(parts) * float(self.accum ** 2)

    def _squares(self, parts: list) -> torch.Tensor:
        """The weighted squares of `parts` (t, copies), of the dp rank's gradient: with context
        parallelism of its cp ranks' parts summed (a reduce-scatter over cp, each rank squaring
        its shard of the sum) and divided by cp (each part is the gradient of its rank's mean
        loss, the dp rank's the mean of them)."""
        if self.cp == 1:
            return _weighted_squares(parts, self.device)
        return _cp_weighted_squares(parts, self.device, self.cp_group, self.cp)

    def take(self, scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """(the step's squared norm at batch b, unscaled by fp16's loss `scale` (None: none); this
        rank's share of the excluded parameters' squared norm in the step's gradient; the
        experts' squared norm at their batch b_experts where they have one, else 0; their share
        of the step's), after the step's reductions and the gradients' unscaling, before
        clipping."""
        if self.batches is None or self.sq is None:
            return None
        sq, self.sq = self.sq, None
        experts, self.sq_experts = self.sq_experts, None
        if scale is not None:
            sq, experts = sq / scale.float().square(), experts / scale.float().square()
        shares = [self._reduced_squares(self.excluded.get), self._reduced_squares(self.experts.__contains__)]
        return torch.stack([sq, shares[0].to(sq.dtype), experts.to(sq.dtype), shares[1].to(sq.dtype)])

    def _reduced_squares(self, which) -> torch.Tensor:
        """This rank's part of the squared norm in the step's reduced gradient of the parameters
        `which(id)` selects: each shard counted once over the ranks holding a copy of it (the
        last stage's copy of a tied embedding not at all: the first stage's holds the same
        gradient)."""
        parts = []
        for p in self.params:
            if which(id(p)) and p.grad is not None:
                g = p.grad
                parts.append((g.to_local() if isinstance(g, DTensor) else g, _world_copies(g, self.tp)))
        return _weighted_squares(parts, self.device)


def _excluded(built) -> dict[int, bool]:
    """{id of a parameter left out (see the module's doc): whether its gradient counts in the
    step's norm (False for the last stage's copy of a tied embedding)}."""
    from raytrain_lm.models import family
    from raytrain_lm.parallel import pp

    out: dict[int, bool] = {}
    if built.pp_on and family(built.cfg.model).tied(built.cfg.model):
        out.update({id(p): id(p) not in built.norm_exclude for p in pp.tied_params(built.parts)})
    if 1 < built.layout.ep == built.layout.dp:  # no smaller batch for the experts
        out.update({i: True for i in _experts(built)})
    return out


def _experts(built) -> set[int]:
    """The ids of the routed experts' parameters (expert parallelism)."""
    from raytrain_lm.parallel import ep, fsdp

    return {id(p) for part in built.parts for experts in ep.experts_of(part, fsdp.blocks(part))
            for p in experts.parameters()}


def _tp_copies(spec, tp: int) -> int:
    """How many ranks of one dp rank hold this whole local gradient: a tp shard is one rank's
    (1); a gradient replicated over tp (Replicate on tp, or no DTensor over tp: `spec` None, or
    on a mesh without tp) is every tp rank's."""
    if tp == 1:
        return 1
    names = (spec.mesh.mesh_dim_names or ()) if spec is not None else ()
    if "tp" not in names:
        return tp
    return tp if spec.placements[names.index("tp")].is_replicate() else 1


def _world_copies(g: torch.Tensor, tp: int) -> int:
    """How many ranks hold a copy of this rank's shard of a reduced gradient: the sizes of the
    mesh dims it is replicated over, and tp where its mesh has no tp dim."""
    if not isinstance(g, DTensor):
        return tp
    names = g.device_mesh.mesh_dim_names or ()
    n = 1
    for i, placement in enumerate(g.placements):
        if placement.is_replicate():
            n *= g.device_mesh.size(i)
    return n * (tp if "tp" not in names else 1)


def _weighted_squares(parts: list, device: torch.device) -> torch.Tensor:
    """sum of |t|^2 / copies over (t, copies) in `parts`, in fp32 (float64 for float64
    gradients), on `device`: one fused norm per number of copies."""
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    dtype = _at_least_fp32(parts[0][0])
    total = torch.zeros((), dtype=dtype, device=device)
    for copies in sorted({c for _, c in parts}):
        tensors = [t for t, c in parts if c == copies]
        norms = torch._foreach_norm(tensors, 2, dtype=dtype)
        total = total + torch.stack(norms).square().sum() / copies
    return total


def _cp_weighted_squares(parts: list, device: torch.device, group, cp: int) -> torch.Tensor:
    """sum of |sum over the cp ranks of t|^2 / copies / cp^2 over (t, copies) in `parts`, this
    rank's share of it: the tensors of one (copies, dtype) flattened into one buffer, padded to a
    multiple of cp, reduce-scattered (summed) over the cp `group` in their own dtype, and this
    rank's shard of the sum squared in fp32 (float64 for float64 gradients)."""
    total = torch.zeros((), dtype=_at_least_fp32(parts[0][0]) if parts else torch.float32,
                        device=device)
    by: dict = {}
    for t, copies in parts:
        by.setdefault((copies, t.dtype), []).append(t.reshape(-1))
    for (copies, _), tensors in sorted(by.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        shard = _cp_sum_shard(torch.cat(tensors), group, cp)
        total = total + torch.linalg.vector_norm(shard, 2, dtype=total.dtype).square() / copies
    return total / cp ** 2


def _cp_sum_shard(flat: torch.Tensor, group, cp: int) -> torch.Tensor:
    """This rank's 1/cp of the sum over the cp `group` of the 1-D `flat` (zero-padded to a
    multiple of cp)."""
    pad = (-flat.numel()) % cp
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shard = flat.new_empty(flat.numel() // cp)
    REDUCE_SCATTER(shard, flat.contiguous(), group=group)
    return shard


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    """The norm's dtype: fp32 for bf16/fp16/fp32 gradients, float64 for a float64 model (a
    reference run) -- a norm may not narrow its input."""
    return torch.promote_types(t.dtype, torch.float32)


def _ddp_of(module: torch.nn.Module) -> Optional[DistributedDataParallel]:
    """The DDP module under a compiled wrapper, or None."""
    module = getattr(module, "_orig_mod", module)
    return module if isinstance(module, DistributedDataParallel) else None


def _fsdp_groups(built) -> list:
    """The FSDP2 parameter groups (fully_shard or replicate) of this rank's parts."""
    from torch.distributed.fsdp import FSDPModule

    groups, seen = [], set()
    for part in built.parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    if id(group) not in seen:
                        seen.add(id(group))
                        groups.append(group)
    return groups


def _squares_before_reduce(group, state: SmallBatchNorm) -> None:
    """Make FSDP2 parameter group `group`'s post-backward first add the squares of the gradients
    it is about to reduce (only where it reduces: the step's last micro-batch). A gradient whose
    placements differ from its parameter's tp placements (Partial under sequence parallelism, a
    Replicate gradient of a Shard parameter) is redistributed as FSDP2 would do next, and kept
    so, so FSDP does not do it twice."""
    post_backward = group.post_backward

    def squares_then_post_backward(*args):
        if state.sq is not None and group.reduce_grads:
            parts, expert_parts = [], []
            for fp in group.fsdp_params:
                if not hasattr(fp, "_unsharded_param") or id(fp.sharded_param) in state.excluded:
                    continue
                fp.accumulate_unsharded_grad_if_needed()  # (idempotent: FSDP calls it next)
                accumulated = fp.unsharded_accumulated_grad is not None
                g = fp.unsharded_accumulated_grad if accumulated else fp.unsharded_param.grad
                if g is None:
                    if state.cp == 1:
                        continue
                    g = torch.zeros_like(fp.unsharded_param)  # the cp ranks reduce the same set
                spec = fp._unsharded_dtensor_spec if fp.is_dtensor else None
                if isinstance(g, DTensor):
                    if tuple(g.placements) != tuple(spec.placements):
                        g = g.redistribute(placements=spec.placements)
                        if accumulated:
                            fp.unsharded_accumulated_grad = g
                        else:
                            fp.unsharded_param.grad = g
                    g = g.to_local()
                into = expert_parts if id(fp.sharded_param) in state.experts else parts
                into.append((g, _tp_copies(spec, state.tp)))
            # (the same calls on every cp rank: their groups reduce in the same order)
            if parts:
                state.sq += state._squares(parts).to(state.sq.dtype) * state.factor
            if expert_parts:
                state.sq_experts += state._squares(expert_parts).to(state.sq.dtype) * state.factor
        return post_backward(*args)

    group.post_backward = squares_then_post_backward


def _squares_then_allreduce(state: "SmallBatchNorm", bucket: dist.GradBucket
                            ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: add the bucket's local sum of squares (this worker's gradient), then the
    default all-reduce of the mean."""
    buffer = bucket.buffer()
    if state.sq is not None:
        state.sq += torch.linalg.vector_norm(buffer, 2, dtype=_at_least_fp32(buffer)).square()
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)


def _squares_over_cp_then_allreduce(state: "SmallBatchNorm", bucket: dist.GradBucket
                                    ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook under context parallelism: the all-reduce over dp x cp done as a
    reduce-scatter over cp, an all-reduce of the shard over dp and an all-gather over cp (the
    same bytes as one all-reduce over every rank), adding the squares of this rank's shard of the
    cp sum (its dp rank's gradient, times cp) in between."""
    buffer = bucket.buffer()
    n = buffer.numel()
    shard = _cp_sum_shard(buffer, state.cp_group, state.cp)
    if state.sq is not None:
        norm = torch.linalg.vector_norm(shard, 2, dtype=_at_least_fp32(shard))
        state.sq += norm.square() / state.cp ** 2
    shard.div_(dist.get_world_size())  # the mean over every rank, as DDP's default hook
    dist.all_reduce(shard, group=state.dp_group)
    out = shard.new_empty(shard.numel() * state.cp)
    work = ALL_GATHER(out, shard, group=state.cp_group, async_op=True)
    return work.get_future().then(lambda _: out[:n])
