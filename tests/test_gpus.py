"""GPU models from real device names (as torch and NVML report them) and from Ray's accelerator
labels: exact matches only, and no memory figure a label does not determine. No GPU needed (the
memory check fakes the device's properties where there is none)."""

import pytest
import torch
from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError
from raytrain_lm.plan.gpus import GPUS, gpu_model, label_memory_gb, peak_tflops

# torch.cuda.get_device_name() of real cards -> (model, dense bf16 peak, memory GB)
DEVICES = [
    ("NVIDIA H200", "H200", 989.0, 141),
    ("NVIDIA H200 NVL", "H200 NVL", 835.0, 141),
    ("NVIDIA H100 80GB HBM3", "H100 80GB", 989.0, 80),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0, 80),
    ("NVIDIA H100 NVL", "H100 NVL", 835.0, 94),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB", 312.0, 80),
    ("NVIDIA A100 80GB PCIe", "A100 80GB", 312.0, 80),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0, 40),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB", 312.0, 40),
    ("NVIDIA L40S", "L40S", 362.0, 48),
    ("NVIDIA L40", "L40", 181.0, 48),
    ("NVIDIA L4", "L4", 121.0, 24),
    ("NVIDIA A10", "A10", 125.0, 24),
    ("NVIDIA A10G", "A10G", 125.0, 24),
    ("NVIDIA GH200 480GB", "GH200", 989.0, 96),
    ("NVIDIA H800", "H800", 989.0, 80),
    ("NVIDIA H800 PCIe", "H800 PCIe", 756.0, 80),
    ("NVIDIA B200", "B200", 2250.0, 180),
    ("Tesla V100-SXM2-16GB", "V100 16GB", None, 16),
    ("Tesla V100-PCIE-32GB", "V100 32GB", None, 32),
    ("Tesla T4", "T4", None, 16),
]


@pytest.mark.parametrize("name,model,peak,memory", DEVICES)
def test_device_names_name_exactly_one_model(name, model, peak, memory):
    assert gpu_model(name) == model
    assert peak_tflops(name) == peak and GPUS[model].memory == memory


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA GeForce RTX 4090",
                                  "NVIDIA RTX 6000 Ada Generation", "NVIDIA L4000",
                                  "NVIDIA A1000", ""])
def test_unknown_models_and_mig_slices_have_no_peak(name):
    assert gpu_model(name) is None and peak_tflops(name) is None


@pytest.mark.parametrize("name,model,peak,memory", DEVICES)
def test_an_fp32_run_is_measured_against_the_fp32_or_tf32_peak(name, model, peak, memory):
    """MFU of an fp32 run against the bf16 peak would understate it by 2x (TF32) or more; a GPU
    without bf16 units is measured in fp16, which `precision auto` runs there."""
    fp32, fp16 = peak_tflops(name, "fp32"), peak_tflops(name, "fp16")
    assert fp32 == GPUS[model].fp32 and fp32 is not None and fp16 is not None
    assert fp32 < fp16 and (peak is None or fp32 < peak)


@pytest.mark.parametrize("label,memory", [
    ("A100", None), ("H100", None), ("V100", None),  # models of different memory share these
    ("A100-80G", 80), ("A100-40G", 40),  # the labels Ray documents for adding by hand
    ("H200", 141), ("L40S", 48), ("L40", 48), ("L4", 24), ("A10G", 24), ("T4", 16),
    ("RTX-PRO-6000", None), ("B200", 180), ("GeForce-RTX-5090", None),
])
def test_ray_labels_give_memory_only_when_they_determine_it(label, memory):
    assert label_memory_gb(label) == memory


@pytest.mark.parametrize("name,model,peak,memory", DEVICES)
def test_the_label_ray_derives_never_overstates_or_understates_memory(name, model, peak, memory):
    """Whatever label Ray gives a node with this device, the driver's figure is its memory or
    none at all (then the worker checks the device itself)."""
    label = NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(name)
    sharing = {m for n, _, _, m in DEVICES
               if NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(n) == label}
    # its memory where every card of that label has the same (H200, L4, ...), else none (A100)
    assert label_memory_gb(label) == (memory if sharing == {memory} else None)


def test_force_reaches_the_workers(tmp_path, monkeypatch):
    """The workers' memory check reads --force from the trainer's train_loop_config: a plan beyond
    the device's memory is refused with the config of a trainer built without --force, and
    goes through with one built with it."""
    from raytrain_lm.run.driver import build_trainer
    from raytrain_lm.store.storage import RunFolder
    from raytrain_lm.worker.metrics import check_device_memory

    cfg = build_config(flags=dict(storage=str(tmp_path), name="r", use_gpu=True, workers=1),
                       sets=BEYOND_80GB)
    fake_device_memory(monkeypatch, 80e9)
    for force in (False, True):
        trainer = build_trainer(cfg, RunFolder(cfg.storage, cfg.name), force=force)
        passed = trainer.train_loop_config.force
        if force:
            check_device_memory(cfg, torch.device("cuda", 0), passed)
        else:
            with pytest.raises(UserError, match="--force"):
                check_device_memory(cfg, torch.device("cuda", 0), passed)


BEYOND_80GB = ["model.n_layer=48", "model.n_embd=4096", "model.n_head=32", "model.block_size=1024",
               "model.vocab_size=50304", "batch_size=64", "seq_len=1024"]


def fake_device_memory(monkeypatch, total: float) -> None:
    """Without a GPU: the device properties torch would report for a card of `total` bytes (the
    one call of torch.cuda that check_device_memory makes)."""
    from types import SimpleNamespace

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: SimpleNamespace(total_memory=total))


def test_a_gpu_worker_refuses_a_plan_beyond_its_device_memory(monkeypatch):
    """On a GPU its real memory; without one, an 80 GB card's reported properties."""
    from raytrain_lm.worker.metrics import check_device_memory

    fake_device_memory(monkeypatch, 80e9)
    cfg = build_config(flags=dict(use_gpu=True, workers=1), sets=BEYOND_80GB)
    device = torch.device("cuda", 0)
    with pytest.raises(UserError, match=r"GiB per worker .* but a worker has [\d.]+ GiB \([\d.]+ usable\); .*--force"):
        check_device_memory(cfg, device, force=False)
    check_device_memory(cfg, device, force=True)
    check_device_memory(build_config(flags=dict(use_gpu=True, workers=1)), device, force=False)


def test_the_progress_line_shows_the_allocators_reservation_beside_the_allocated_peak():
    from raytrain_lm.results.tables import progress_line

    row = {"step": 4, "loss": 2.5, "lr": 1e-3, "tokens_per_second": 5e3, "data_wait_frac": 0.0,
           "peak_mem_gb": 10.0, "peak_mem_reserved_gb": 12.5, "step_time": 0.1}
    assert "mem 10.00 GB (12.50 reserved)" in progress_line(row, 10)
    assert "reserved" not in progress_line({**row, "peak_mem_reserved_gb": None}, 10)  # CPU
