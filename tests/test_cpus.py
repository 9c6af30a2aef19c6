"""CPUs (torch threads) per worker: the machine's cores shared on a Ray of our own, the user's
setting kept, and the line when a cluster's workers leave a node's CPUs idle (cpus.py)."""

import pytest

from raytrain_lm.config.load import build_config
from raytrain_lm.run.cpus import decide, idle_line, local_share, pack, torch_threads


@pytest.mark.parametrize("cores,workers,trials,share", [
    (2, 1, 1, 2), (2, 2, 1, 1), (2, 3, 1, 1), (16, 3, 1, 5), (16, 2, 2, 4), (8, 1, 16, 1)])
def test_local_share_divides_the_cores_among_the_workers(cores, workers, trials, share):
    assert local_share(cores, workers, trials) == share


def test_own_ray_shares_the_cores_and_says_so():
    chosen = decide(None, 1, own_ray=True, cores=2)
    assert (chosen.cpus, chosen.threads) == (2, 2)
    assert "1 worker x 2 CPUs (2 torch threads each; this machine's 2 cores" in chosen.line
    four = decide(None, 4, own_ray=True, cores=16, trials=2)
    assert (four.cpus, four.threads) == (2, 2) and "4 workers per trial, 2 trials at once" in four.line


def test_the_users_setting_wins_everywhere():
    for own in (True, False):
        chosen = decide(0.5, 1, own_ray=own, cores=2)
        assert (chosen.cpus, chosen.threads) == (0.5, 1)  # Ray gives a fraction 1 thread
    assert "as set" in decide(3.0, 1, own_ray=True, cores=2).line
    assert decide(3.0, 1, own_ray=False, cores=2).line is None


def test_a_cluster_keeps_rays_default():
    chosen = decide(None, 1, own_ray=False, cores=64)
    assert (chosen.cpus, chosen.threads, chosen.line) == (1.0, 1, None)


def test_omp_num_threads_set_for_the_workers_decides_their_threads():
    assert torch_threads(2.0, None) == 2 and torch_threads(2.9) == 2 and torch_threads(0.25) == 1
    assert torch_threads(1.0, "6") == 6 and torch_threads(1.0, "x") == 1
    chosen = decide(None, 1, own_ray=True, cores=2, omp_env="1")
    assert chosen.threads == 1 and "OMP_NUM_THREADS=1 is set" in chosen.line


def test_cpus_per_worker_defaults_to_deciding_at_launch_and_a_set_value_stays():
    assert build_config().cpus_per_worker is None and build_config().worker_cpus == 1.0
    cfg = build_config(sets=["cpus_per_worker=0.5"])
    assert cfg.cpus_per_worker == cfg.worker_cpus == 0.5


def test_pack_fills_the_largest_node_first():
    nodes = [{"CPU": 4}, {"CPU": 16}, {"CPU": 8}]
    assert [(n["CPU"], k) for n, k in pack(nodes, 18, 1.0, gpu=False)] == [(16, 16), (8, 2)]
    gpu_nodes = [{"CPU": 96, "GPU": 8}, {"CPU": 96, "GPU": 8}]
    assert [k for _, k in pack(gpu_nodes, 12, 1.0, gpu=True)] == [8, 4]


def test_idle_line_names_the_node_left_idle_and_the_setting_to_use():
    line = idle_line([{"CPU": 96, "GPU": 8}], 8, 1.0, gpu=True)
    assert "8 workers x 1 CPU (1 torch thread each) leave 88 of a node's 96 CPUs idle" in line
    assert "--set cpus_per_worker=12" in line
    assert idle_line([{"CPU": 2}], 1, 1.0, gpu=False).endswith("cpus_per_worker=2 gives each worker 2 threads")


@pytest.mark.parametrize("nodes,workers,cpus,omp", [
    ([{"CPU": 2}], 2, 1.0, None),  # every core has its worker
    ([{"CPU": 3}], 2, 1.0, None),  # one spare CPU, not one per worker: Ray's own tasks use it
    ([{"CPU": 96, "GPU": 8}], 8, 12.0, None),
    ([{"CPU": 96, "GPU": 8}], 8, 1.0, "12"),  # the workers' OMP_NUM_THREADS uses the CPUs
    ([{"CPU": 0}], 2, 1.0, None),  # no node holds a worker yet (an autoscaler will add them)
])
def test_no_idle_line_when_the_cpus_are_used(nodes, workers, cpus, omp):
    assert idle_line(nodes, workers, cpus, gpu=bool(nodes[0].get("GPU")), omp_env=omp) is None
