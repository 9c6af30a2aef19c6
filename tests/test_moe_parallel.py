"""Expert parallelism over gloo, on the local harness (local_mode.py): every layout with --ep
trains the one-worker mixture of experts step for step (losses and gradient norms within 1e-5,
the same tokens per expert), and checkpoints move between ep and other layouts. No Ray here, so
these runs go to the pytest worker beside the Ray group; the one Ray run of expert parallelism
is test_moe_ray.py's."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import row_losses, step_losses
from local_mode import run_local
from raytrain_lm.config.load import build_config

STEPS = 10
GLOBAL_BATCH = 16
# moe-tiny at 2 layers and half its width: 4 experts of 64 units, 2 per token.
MODEL = ["model.n_layer=2", "model.n_embd=64", "model.ffn_dim=64", "model.block_size=64"]
LAYOUTS = {  # name: (workers, flags)
    "one": (1, {}),
    "ep2": (2, dict(ep=2, strategy="zero1")),  # all of dp is one ep group (DeepSeek-V3's ZeRO-1)
    "fsdp2xep2": (4, dict(ep=2, strategy="fsdp")),  # experts sharded over the other 2 dp ranks
    "tp2xep2-sp": (4, dict(tp=2, ep=2, strategy="zero2", sequence_parallel=True)),
    "pp2xep2": (4, dict(pp=2, ep=2, strategy="ddp", pp_schedule="1f1b", microbatches=4)),
    # context parallelism: each window's tokens routed on the cp ranks holding its chunks, the
    # balance loss's expert shares summed over them; at ep 1 (Ray's DDP over the cp ranks) and
    # composed with ep (an ep group per cp index, the experts sharded over edp x cp)
    "cp2": (2, dict(cp=2)),
    "cp2xep2": (4, dict(cp=2, ep=2, strategy="fsdp")),
    # a pipeline whose stages' attention gathers over their cp group, each stage's balance loss
    # summing its expert shares over the cp ranks
    "cp2xpp2": (4, dict(cp=2, pp=2, strategy="ddp", pp_schedule="1f1b", microbatches=4)),
    # cp x ep x tp is not here: its smallest layout is 8 ranks (ep divides dp, so dp 2), whose run
    # costs several times these; cp x ep and tp x ep train here, cp x tp (the Llama) in
    # test_context_parallel, and its mesh groups are test_cp_and_ep_groups_are_the_layouts_coordinates'
    # (fake ranks)
}


def moe_config(data, storage, name, workers, flags, **more):
    dp = workers // (flags.get("tp", 1) * flags.get("pp", 1) * flags.get("cp", 1))
    return build_config(preset="moe-tiny", sets=MODEL, flags={**dict(
        workers=workers, cpus_per_worker=0.5 if workers > 2 else 1.0, max_steps=STEPS,
        batch_size=GLOBAL_BATCH // dp, seq_len=64, lr=3e-3, warmup_steps=3, log_every=1,
        eval_every=STEPS, checkpoint_every=5 if name == "ep2" else 0, data=str(data),
        storage=str(storage), name=name, seed=5), **flags, **more})


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-layouts")


@pytest.fixture(scope="module")
def runs(pydoc_data, storage):
    """Each layout's metrics rows on the harness (one per step), made on first use."""
    done = {}

    def get(name):
        if name not in done:
            rows = []
            summary = run_local(moe_config(pydoc_data, storage, name, *LAYOUTS[name]),
                                on_metrics=rows.append)
            assert summary["status"] == "completed", name
            done[name] = rows
        return done[name]

    return get


def assert_trains_the_one_worker_model(rows, one):
    """`rows` (a run's, the latest row of each step) against the one-worker run's, step by step."""
    by_step = {r["step"]: r for r in rows}
    assert sorted(by_step) == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for o in one:
        r = by_step[o["step"]]
        assert r["loss"] == pytest.approx(o["loss"], rel=1e-5), r["step"]
        assert r["grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-5), r["step"]
        assert r["expert_load"] == o["expert_load"], r["step"]  # the same tokens reach each expert
        assert r["aux_loss"] == pytest.approx(o["aux_loss"], rel=1e-5), r["step"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "one"])
def test_every_ep_layout_trains_the_one_worker_model(runs, layout):
    """Each step's loss, gradient norm and balance loss within 1e-5 of one worker's, and each
    layer's max/mean tokens per expert equal: the same routing (dropless, sorted, in fp32) on
    the same tokens, the experts' gradients summed over the ep group's losses and scaled to the
    global mean (parallel/ep.py), the dense ones averaged over dp; with tp the MoE layers whole
    on each tp rank, with pp the balance loss attached to each stage's output."""
    assert_trains_the_one_worker_model(runs(layout), runs("one"))


@pytest.mark.slow
def test_moe_tiny_learns_and_reports_its_balance(runs):
    """The one-worker run's loss falls; every row carries the balance loss (near 1.0) and each
    of the 2 layers' max/mean expert load; the ep layouts' all-to-alls show as the ep dim's
    bytes."""
    one = runs("one")
    assert one[-1]["loss"] < one[0]["loss"] - 0.5
    assert all(0.9 < r["aux_loss"] < 1.5 and len(r["expert_load"]) == 2 and
               min(r["expert_load"]) >= 1.0 for r in one)
    assert runs("ep2")[-1]["comm_bytes"]["ep"] > 0 and runs("fsdp2xep2")[-1]["comm_bytes"]["edp"] > 0
    # cp x ep at edp 1: the experts' group (edp x cp) is the cp ranks, its bytes named cp
    both = runs("cp2xep2")[-1]["comm_bytes"]
    assert both["ep"] > 0 and both["cp"] > 0 and "edp_cp" not in both


@pytest.mark.slow
@pytest.mark.parametrize("to,flags", [("one", dict(workers=1, ep=1, strategy="ddp", batch_size=16)),
                                      ("fsdp2", dict(workers=2, ep=1, strategy="fsdp", batch_size=8))])
def test_an_ep2_checkpoint_resumes_at_another_layout(runs, storage, to, flags):
    """Saved at --ep 2 (DCP: the experts' shards under the one-process names), continued at one
    worker and at --strategy fsdp --workers 2 without ep: the next steps' losses are the
    uninterrupted ep2 run's."""
    uninterrupted = row_losses(runs("ep2"))
    name = f"ep2-to-{to}"
    shutil.copytree(storage / "ep2", storage / name)
    torn = storage / name / f"checkpoint_{STEPS:08d}" / "state.pt"
    torn.write_bytes(torn.read_bytes()[:100])  # the final checkpoint is skipped: resume from 5
    cfg = build_config(base=json.loads((storage / name / "config.json").read_text()),
                       flags={**flags, "max_steps": 7})
    cfg.name = name
    summary = run_local(cfg, resume=True)
    assert summary["resumed_from_step"] == 5
    resumed = step_losses(storage / name)
    for step in (6, 7):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step


@pytest.mark.slow
def test_a_mixtral_folder_starts_an_ep2_run_from_its_weights(pydoc_data, storage, tmp_path):
    """`train --init-from` a Hub-shaped Mixtral folder (per-expert tensors in bf16 shards) at
    --ep 2 x fsdp over 2 ranks: the model is the folder's config.json, each rank's experts are
    its half of the folder's, and the first step's loss is transformers' on that step's global
    batch (both ranks' sequences)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from conftest import batches_as_read
    from raytrain_lm.store.hf_folder import folder_model
    from test_families import save_hub_folder
    from test_moe_hf import HUB

    save_hub_folder(tmp_path / "mixtral", HUB["mixtral"], seed=3)
    flags = dict(workers=2, ep=2, strategy="fsdp", max_steps=1, batch_size=8, seq_len=48,
                 checkpoint_every=-1, eval_every=1, eval_windows=4, log_every=1,
                 data=str(pydoc_data), storage=str(storage), name="mixtral-ep2", seed=5)
    cfg = build_config(flags=flags, folder=folder_model(tmp_path / "mixtral"))
    assert (cfg.model.arch, cfg.model.n_experts, cfg.model.qk_norm) == ("moe", 4, False)
    run_local(cfg, init_from=str(tmp_path / "mixtral"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral", dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [F.cross_entropy(theirs(x).logits.flatten(0, 1), y.reshape(-1)).item()
                  for x, y in (batches_as_read(cfg, rank, 2).next() for rank in range(2))]
    assert step_losses(storage / "mixtral-ep2")[1] == pytest.approx(sum(losses) / 2, rel=1e-5, abs=1e-5)
