"""The benchmarks under bench/ run end to end (no timing is asserted: speed is the benchmarks' job,
not the tests'). No Ray here: the GPU benchmark must not need it, and the torchrun baseline is
plain torch.distributed between two real processes over gloo."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT



def test_gpu_throughput_smoke_runs_on_cpu_without_ray(tmp_path):
    # A `ray` package that cannot be imported, first on the path: as on a GPU host without Ray.
    shadow = tmp_path / "no_ray" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('ray is not installed on this host')\n")
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(shadow.parent), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_throughput.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
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
    assert "written:" in proc.stdout and "tok/s" in proc.stdout


def test_gpu_throughput_refuses_cpu_without_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_throughput.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and proc.stderr.startswith("error: no CUDA GPU")
    assert not out.exists()


@pytest.mark.ray  # the integration tier: real gloo DDP between torchrun's processes (~35 s)
def test_torchrun_baseline_through_the_overhead_harness(tmp_path, pydoc_data):
    """bench/overhead.py's Ray-free side end to end: torchrun starts bench/torchrun_ddp.py as two
    real processes (gloo DDP); they train and log, and the harness summarises the run."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--only", "torchrun",
                           "--reps", "1", "--steps", "12", "--log-every", "3", "--warmup-steps", "3",
                           "--data", str(pydoc_data), "--out", str(out), "--keep"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = Path(proc.stdout.split("runs kept in ", 1)[1].split()[0])
    try:
        run_dir = kept / "torchrun-0"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [3, 6, 9, 12]
        assert rows[-1]["tokens"] == 12 * 2 * 16 * 128  # steps x processes x batch x seq_len (tiny)
        assert rows[0]["loss"] > rows[-1]["loss"] and math.isfinite(rows[-1]["val_loss"])
        assert all(r["torch_threads"] == 1 for r in rows)  # OMP_NUM_THREADS=1, as Ray gives a worker
        assert (run_dir / "checkpoint_00000012" / "state.pt").is_file()
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    result = json.loads(out.read_text())
    run = result["runs"][0]["torchrun"]
    assert run["steady_steps"] == 9 and run["wall_tokens_per_second"] > 0
    assert 0 <= run["data_wait_frac"] < 1 and run["time_to_first_step"] > 0
    assert result["summary"]["torchrun"]["wall_tokens_per_second"]["median"] == run["wall_tokens_per_second"]
    assert "ratio" not in result and "wall tok/s" in proc.stdout
