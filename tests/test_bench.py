"""The benchmarks under bench/ run end to end (no timing is asserted: speed is the benchmarks' job,
not the tests'). No Ray here: the GPU benchmark must not need it, and the torchrun baseline is
plain torch.distributed between two real processes over gloo."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT


@contextlib.contextmanager
def bench_module(name: str):
    """bench/NAME.py imported in this process (its main() called in-process spares a fresh
    interpreter's torch import)."""
    import importlib

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def assert_throughput_smoke(result: dict) -> None:
    """bench/gpu_throughput.py --smoke's record (the GPU check's smoke runs it, without Ray)."""
    assert result["ray_imported"] is False
    assert [(r["mode"], r["batch_size"], r["status"]) for r in result["results"]] == \
        [("eager", 2, "ok"), ("eager", 4, "ok")]
    m = result["model"]
    # The smoke model, counted by hand: 2 blocks of 12 x 64^2 weights + 2 x 64 LayerNorm gains,
    # the tied 50,304 x 64 embedding and the final LayerNorm's 64: N = 3,318,080 (no biases).
    # 6N + 12 x 2 layers x 2 heads x 32 x 64 tokens = 19,908,480 + 98,304.
    assert (m["vocab_size"], m["n_layer"], m["n_head"], m["n_embd"], m["seq_len"]) == (50304, 2, 2, 64, 64)
    assert m["num_parameters_matmul"] == 3_318_080
    assert result["flops_per_token"] == 20_006_784
    for r in result["results"]:
        assert r["tokens_per_second"] > 0 and r["peak_mem_gb"] > 0 and r["mfu"] is None  # no MFU on CPU
        # Random tokens: the loss starts at about ln(vocab).
        assert abs(r["loss_first"] - math.log(m["vocab_size"])) < 0.5 and math.isfinite(r["loss_last"])


def test_gpu_throughput_refuses_cpu_without_smoke(tmp_path, capsys):
    import torch

    out = tmp_path / "gpu.json"
    # the device it picks where torch sees no GPU; on a GPU host, that device named
    cpu = ["--device", "cpu"] if torch.cuda.is_available() else []
    with bench_module("gpu_throughput") as bench, pytest.raises(SystemExit) as exit:
        bench.main(["--out", str(out), *cpu])
    assert exit.value.code == 2 and capsys.readouterr().err.startswith("error: no CUDA GPU")
    assert not out.exists()


@pytest.mark.ray  # the integration tier: four torchrun launches
def test_overhead_harness_times_whole_processes(tmp_path, pydoc_data):
    """bench/overhead.py end to end on its two Ray-free arms: each arm runs at both step counts,
    per-step time is the difference of whole-process wall times, speed is relative to the
    first arm, and the table prints it. The `project` arm is bench/torchrun_ddp.py: torchrun
    starts a real process (gloo DDP) that trains in the project's data order and logs rows like
    a Ray run's. One process per launch: the harness's arithmetic is the same at any count, and
    a torchrun of two ranks is test_workers_0.py's (it trains like two Ray workers)."""
    out, runs = tmp_path / "overhead.json", tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--arm", "textbook",
                           "--arm", "project", "--reps", "1", "--steps", "4,12", "--workers", "1",
                           "--data", str(pydoc_data), "--out", str(out), "--keep", str(runs)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-8000:]
    result = json.loads(out.read_text())
    run = result["runs"][0]
    walls = {arm: (run[arm]["4"]["wall_seconds"], run[arm]["12"]["wall_seconds"])
             for arm in ("textbook", "project")}
    ms = {arm: 1000 * (t12 - t4) / 8 for arm, (t4, t12) in walls.items()}
    summary = result["summary"]
    assert summary["per_step_ms"]["project"]["median"] == pytest.approx(ms["project"])
    assert summary["speed_vs_textbook"]["project"]["median"] == pytest.approx(ms["textbook"] / ms["project"])
    assert "speed vs textbook" in proc.stdout and "project" in proc.stdout
    # the project arm's 12-step run (repetition 0, arm 1): its rows and final checkpoint
    run_dir = runs / "r0-1-12"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 12 and rows[-1]["tokens"] == 12 * 1 * 16 * 128  # x processes x batch x seq
    assert rows[0]["loss"] > rows[-1]["loss"] and math.isfinite(rows[-1]["val_loss"])
    assert all(r["torch_threads"] == 1 for r in rows)  # OMP_NUM_THREADS=1, as Ray gives a worker
    assert (run_dir / "checkpoint_00000012" / "state.pt").is_file()


@pytest.mark.parametrize("spec", ["rayy", "ray[A]", "textbook[A=1]", "ray[A=1"])
def test_overhead_refuses_a_bad_arm(spec):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--arm", spec],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--arm" in proc.stderr


def test_overhead_keeps_the_repetitions_a_failed_run_did_not_touch():
    """A run that fails (torchrun's rank 1 once died of SIGABRT in the 5th repetition) leaves its
    repetition out of the figures and is counted; the four complete ones still make the summary
    (the harness used to exit and throw away 20 minutes of runs)."""
    with bench_module("overhead") as overhead:
        summarise = overhead.summarise

    def rep(textbook_long, ray_long, failed=False):
        ray = {60: {"wall_seconds": 30.0}, 300: {"wall_seconds": ray_long}}
        if failed:
            ray[300] = {"error": "exit -6"}
        return {"textbook": {60: {"wall_seconds": 15.0}, 300: {"wall_seconds": textbook_long}},
                "ray": ray}

    runs = [rep(63.0, 78.0), rep(63.0, 78.0, failed=True), rep(51.0, 66.0)]
    summary = summarise(runs, ["textbook", "ray"], 60, 300)
    assert summary["repetitions"] == 2 and summary["repetitions_left_out"] == 1
    assert summary["per_step_ms"]["textbook"]["values"] == [200.0, 150.0]  # (63 - 15) / 240 s
    assert summary["speed_vs_textbook"]["ray"]["values"] == [1.0, 1.0]


def test_import_floor_times_each_import_in_fresh_processes(tmp_path):
    """bench/import_floor.py on cheap modules: one process alone, then two at once, each module
    timed on top of the ones before it."""
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "import_floor.py"), "--reps", "1",
                           "--modules", "json,email.parser", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["modules"] == ["json", "email.parser"]
    assert [len(result[k]["runs"]) for k in ("alone", "two at once")] == [1, 2]
    for run in result["alone"]["runs"] + result["two at once"]["runs"]:
        assert all(wall > 0 and cpu >= 0 for wall, cpu in run.values())
    assert "email.parser" in proc.stdout and "total" in proc.stdout


@pytest.mark.parametrize("side,cpus", [("one_process", 2), ("threads", 1)])
def test_prepare_bench_child_runs_the_side_it_is_told(tmp_path, side, cpus):
    """bench/prepare.py's one-process child labels its row with the side it was given, whatever
    --cpus is (it once guessed the side from the thread count: threads at --cpus 1 came back as
    one_process and the summary had no threads rows)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "prepare.py"), "--cpus", str(cpus),
                           "--one-process-run", "pydoc", "byte", str(tmp_path / "out"), side],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["side"] == side and row["tokens"] > 0 and len(row["shards"]) >= 2


def test_llama_vs_gpt_bench_times_both_at_equal_parameters(tmp_path, capsys):
    """bench/llama_vs_gpt.py on one block each: the Llama's SwiGLU hidden size brings it to the
    GPT's parameter count (within 0.1%), both are timed and the ratio is theirs."""
    out = tmp_path / "lvg.json"
    with bench_module("llama_vs_gpt") as bench:
        bench.main(["--steps", "1", "--reps", "1", "--batch-size", "2", "--out", str(out)])
    assert capsys.readouterr().out.startswith("model ")
    rows = json.loads(out.read_text())["rows"]
    gpt, llama = rows["gpt tiny"], rows["llama tiny"]
    assert llama["model"]["arch"] == "llama" and gpt["model"]["arch"] == "gpt"
    assert llama["parameters"] == pytest.approx(gpt["parameters"], rel=1e-3)
    assert json.loads(out.read_text())["llama_over_gpt"] == pytest.approx(
        llama["tokens_per_s_median"] / gpt["tokens_per_s_median"])


GPU_HOST_LACKS = ("ray", "pyarrow", "typer", "yaml", "tokenizers")


def torch_alone(tmp_path) -> dict:
    """The environment of the GPU host bench/gpu_check.py is for (torch and numpy only): each
    package it lacks shadowed by one that cannot be imported, and no GPU."""
    shadow = tmp_path / "torch_alone"
    for name in GPU_HOST_LACKS:
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)]),
            "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow  # a process that imports every module (~5 s); the smoke test below implies it
def test_gpu_check_imports_everything_with_torch_alone(tmp_path):
    """Every module bench/gpu_check.py and its children import (import_all, which the check
    calls first) imports with Ray, pyarrow, typer, yaml and tokenizers unimportable; the smoke
    test below checks that its processes load no project module outside that list."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import gpu_check; "
            "print(json.dumps([gpu_check.import_all(), sorted(sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=torch_alone(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    project, loaded = json.loads(proc.stdout.splitlines()[-1])
    assert "raytrain_lm.worker.step" in project and "raytrain_lm.store.checkpoint_format" in project
    assert not set(GPU_HOST_LACKS) & set(loaded)


@pytest.mark.slow  # a process group, two layouts built and freed with the collector off (~2 s)
def test_gpu_check_frees_a_cyclic_layout_before_the_next_row():
    """FSDP's and the pipeline's modules hold themselves in reference cycles: after one of their
    rows, the check's `release` (gc.collect, then the allocator's cache) brings the memory its
    tracker counts (gpu_check_layout.allocated_bytes: CUDA's allocated bytes, on the CPU every
    live tensor's storage) back to what it was before the row, so the next row's peak is its
    own. The automatic collector is off: whether it happens to run between two rows decides
    nothing. Less than the layout's smallest parameter may differ (a leaked layout holds all of
    them)."""
    import gc

    import torch
    import torch.distributed as dist

    with bench_module("gpu_check_layout") as layout:
        from raytrain_lm.worker.step import TrainStep

        cpu = torch.device("cpu")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        gc.collect()
        gc.disable()
        try:
            for settings, force in (({"strategy": "fsdp"}, ("fsdp",)), ({}, ("pp",))):
                before = layout.allocated_bytes(cpu)
                cfg = layout.config("smoke", settings)
                step = TrainStep(cfg, cpu, force=frozenset(force))
                step.train()
                step(layout.PinnedBatches(cfg.model.vocab_size, cfg.batch_size, cfg.seq_len, cpu), 1e-3)
                smallest = min(p.numel() * p.element_size() for p in step.model.params())
                held = layout.allocated_bytes(cpu)
                del step
                layout.release(cpu)
                after = layout.allocated_bytes(cpu)
                assert held - before > smallest and after - before < smallest, (force, before, held, after)
        finally:
            gc.enable()
            dist.destroy_process_group()


@pytest.mark.slow  # two layouts on the CPU, then the whole process group killed (~15 s)
def test_gpu_check_keeps_every_finished_row_when_killed(tmp_path):
    """A killed check (the outer timeout, a watchdog abort) leaves each row it finished: here
    the check and its child are killed (SIGKILL, nothing can clean up) once two rows are in."""
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke",
                             "--skip-throughput", "--layouts", "ddp,fsdp,tp,pp 1f1b,zero2",
                             "--out-dir", str(out)], env=torch_alone(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    deadline, rows = time.time() + 240, []
    try:
        while time.time() < deadline and proc.poll() is None and len(rows) < 2:
            time.sleep(0.2)
            try:
                rows = json.loads((out / "gpu_check.json").read_text())["layouts"]
            except (OSError, ValueError):  # not written yet (it is replaced whole, never half)
                pass
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        printed = proc.communicate()[0]
    assert len(rows) >= 2, printed
    kept = json.loads((out / "gpu_check.json").read_text())["layouts"]
    assert [r["layout"] for r in kept[:2]] == ["ddp", "fsdp"]
    assert all(r["status"] == "ok" and r["step_time"] > 0 for r in kept[:2])
    lines = printed.splitlines()  # the check's estimate of its length, then a line per row
    assert lines[0].startswith("5 rows; expected on an H100:"), printed
    assert lines[1].startswith("ddp ") and " ok " in lines[1], printed
    assert len([line for line in (out / "rows.jsonl").read_text().splitlines()
                if '"status"' in line]) >= 2


@pytest.mark.slow  # every layout on the CPU, the compiled ones in processes of their own (minutes)
@pytest.mark.timeout(1500)  # its subprocess's own limit (a loaded machine compiles for minutes)
def test_gpu_check_smoke_runs_every_layout_on_cpu_with_torch_alone(tmp_path):
    """bench/gpu_check.py, prepared for one GPU, runs the same code here on the CPU, in the
    environment of the GPU host (no Ray, pyarrow, typer, yaml or tokenizers)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke",
                           "--out-dir", str(out)], env=torch_alone(tmp_path),
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    with bench_module("gpu_check") as gpu_check:
        names = [name for name, _, _ in gpu_check.LAYOUTS]
    rows = {r["layout"]: r for r in result["layouts"]}
    attention = {name: rows.pop(name) for name in list(rows) if name.startswith("attention")}
    assert sorted([*rows, *attention]) == sorted(names)
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert result["gpt_layouts_start_equal"] is True and result["machine"]["torch"]
    # every process: no Ray, and no project module outside what the fast test imports
    assert len(result["modules"]) == 4  # the eager layouts' process and 3 compiled ones
    for m in result["modules"]:
        assert m["ray_imported"] is False and set(m["loaded"]) <= set(m["imported"])
    assert rows["fsdp"]["fsdp_mixed"] is False and rows["ddp fp16+scaler"]["precision"] == "fp16"
    for name, r in rows.items():  # the loop's metrics row of the timed steps, and validation
        assert r["step_time"] > 0 and r["tokens_per_second"] > 0 and r["data_wait_frac"] >= 0
        assert ("pp" in r["force"]) == (r["bubble"] is not None), name
        assert r.get("dcp") == ("ok" if r["force"] else None), name  # sharded: a round trip
        # what earlier rows left, after gc.collect(): less than one of the smoke model's
        # 32 x 32 fp32 weight matrices (a layout left behind holds all of them)
        assert r["held_at_start_gb"] * 1e9 < 32 * 32 * 4, name
    # the mixture of experts: bf16 and fp32, DDP and FSDP, the all-to-all dispatch on one rank
    moe = {name: r for name, r in rows.items() if r["arch"] == "moe"}
    assert {(r["precision"], r["force"] == ["fsdp"], r["all_to_all"]) for r in moe.values()} == {
        ("bf16", False, False), ("fp32", False, False), ("bf16", True, False), ("fp32", True, False),
        ("bf16", False, True)}
    # attention, per path: the kernel that ran (the CPU's flash kernel here) and the fused
    # kernels that take the path alone (neither CUDA one on a CPU); two packed documents under
    # --doc-mask's span (its dense mask on a CPU, flex_attention's block mask on a GPU)
    for path in ("causal", "sliding-window"):
        r = attention[f"attention {path}"]
        assert r["status"] == "ok" and r["step_time"] > 0, r
        assert r["kernel"] == "flash" and r["fused_kernels"] == ["flash"], r
        assert any("flash_attention_for_cpu" in op for op in r["sdpa_ops"]), r
    assert "dense_step_time" not in attention["attention causal"]
    # the masked paths (the sliding window past it, two documents, --cp 2's chunk order) against
    # their mask dense: on a CPU the masked path is the dense mask itself, so the same outputs
    # (on a GPU: flex_attention's)
    for path in ("sliding-window", "documents", "cp-chunks"):
        r = attention[f"attention {path}"]
        assert r["status"] == "ok" and r["step_time"] > 0 and r["dense_step_time"] > 0, r
        assert r["dense_max_diff"] == 0.0 and r["dense_kernel"] == "flash", r
    assert_throughput_smoke(result["gpt2"])  # bench/gpu_throughput.py --smoke, in its own process
    assert "tok/s" in proc.stdout and f"written: {out / 'gpu_throughput.json'}" in proc.stdout
    assert len(result["memory_plan"]) == 4 and "written:" in proc.stdout


def test_gpu_check_expects_every_row_within_its_budget():
    """Each row of bench/gpu_check.py has its expected seconds on an H100; with the process
    starts and gpu_throughput's run they fit the default --budget, so every row runs within the
    8 minutes of `timeout 480`."""
    with bench_module("gpu_check") as gpu_check:
        names = [name for name, _, _ in gpu_check.LAYOUTS]
        assert set(gpu_check.EXPECTED_S) == set(names)
        total = gpu_check.expected_seconds(names)
        rows = sum(gpu_check.EXPECTED_S.values())
        compiled = sum(bool(s.get("compile")) for _, s, _ in gpu_check.LAYOUTS)
    assert total == rows + gpu_check.PROCESS_START_S * (1 + compiled) + gpu_check.THROUGHPUT_S
    assert total <= gpu_check.BUDGET_S < 480


def test_every_planted_bug_still_applies_and_names_tests_that_exist():
    """bench/mutants.py's planted bugs keep pace with the code: each one's line is in its file
    exactly once and each test named to catch it exists (a mutant that no longer applies, or
    names a renamed test, would guard nothing)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import mutants

    assert len(mutants.MUTANTS) >= 14
    assert [p for m in mutants.MUTANTS for p in mutants.check_applies(m)] == []
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
