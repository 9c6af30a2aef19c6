"""`train --layout auto`: the planner's choice for the run's workers on the cluster Ray reports,
applied to the run; refused in one line where nothing fits. The last test trains with it on the
session's CPU cluster."""

import pytest

from raytrain_lm.config.checks import validate
from raytrain_lm.config.layout import Layout
from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError
from raytrain_lm.plan.auto import auto_cluster, choose_layout, cluster_shape
from raytrain_lm.plan.estimate import estimate_layout

SETS = ["model.n_layer=4", "model.n_head=4", "model.n_embd=64", "model.block_size=64",
        "model.vocab_size=256"]


def cfg_of(**flags):
    return build_config(sets=SETS, flags={"workers": 4, "batch_size": 4, "seq_len": 64,
                                          "layout": "auto", **flags})


def test_auto_applies_the_planners_best_layout():
    cfg = cfg_of()
    cl = auto_cluster(cfg, 4, 8.0)
    best, why = choose_layout(cfg, cl)
    best.layout.apply(cfg)
    validate(cfg)  # train accepts it
    assert Layout.of(cfg) == best.layout  # what train builds is what was planned
    assert cfg.workers * cfg.batch_size * cfg.grad_accum == 16 or cfg.pp > 1
    assert Layout.of(cfg).dp * Layout.of(cfg).sequences == 16  # the global batch kept
    assert "fastest of the" in why and estimate_layout(cfg.model, best.layout, cl).fits


def test_auto_refuses_in_one_line_where_nothing_fits():
    cfg = build_config(preset="gpt-70b", flags={"workers": 8, "use_gpu": True, "layout": "auto",
                                                "model": {"vocab_size": 50304}})
    with pytest.raises(UserError, match="--layout auto: no layout of 8 workers fits") as e:
        choose_layout(cfg, auto_cluster(cfg, 8, 80))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="needs the memory per worker"):
        auto_cluster(cfg, 8, None)


def test_cluster_shape_from_rays_nodes_and_flags():
    nodes = [{"Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0}},
             {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 16.0}}]
    gpu = cfg_of(use_gpu=True, workers=16)
    assert cluster_shape(gpu, nodes, 80.0) == (8, 80.0)
    assert cluster_shape(cfg_of(use_gpu=True, gpus_per_node=4, gpu_memory_gb=40), nodes, 80.0) == (4, 40)
    cpu = cfg_of(cpus_per_worker=0.5)
    assert cluster_shape(cpu, [{"Alive": True, "Resources": {"CPU": 2.0}}], 3.0) == (4, 3.0)
    assert auto_cluster(gpu, 8, 80).gpus_per_node == 8 and auto_cluster(cfg_of(), 3, 1).gpus_per_node == 1


def test_layout_values_are_checked():
    with pytest.raises(UserError, match="--layout must be auto"):
        validate(cfg_of(layout="manual"))
    with pytest.raises(UserError, match="--layout auto plans one worker count"):
        validate(cfg_of(min_workers=2))


def test_train_with_layout_auto_on_cpu_workers(ray_address, pydoc_data, tmp_path):
    from raytrain_lm.run.driver import run_training

    said = []
    cfg = build_config(sets=[s for s in SETS if "vocab" not in s], flags=dict(
        workers=2, cpus_per_worker=0.5, max_steps=4, batch_size=4, seq_len=64, log_every=2,
        eval_every=4, checkpoint_every=0, data=str(pydoc_data), storage=str(tmp_path),
        name="auto", layout="auto"))
    summary = run_training(cfg, say=said.append)
    assert summary["status"] == "completed"
    line = next(s for s in said if s.startswith("layout auto: --tp"))
    assert "fastest of the" in line
