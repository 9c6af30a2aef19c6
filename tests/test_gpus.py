"""GPU kinds from real device names (as torch and NVML report them) and from Ray's accelerator
labels: exact matches only, and no memory figure a label does not determine; every figure read from
the one table (plan/gpu_kinds.json). No GPU needed (the memory check fakes the device's properties
where there is none)."""

import pytest
import torch
from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError
from raytrain_lm.plan.gpus import kind_of_device, kind_of_label, label_memory_gb, peak_tflops
from raytrain_lm.plan.kinds import kinds

# The former device table (main's raytrain_lm/plan/gpus.py GPUS before gpu_kinds.json took it in),
# verbatim: model -> (bf16, fp16, fp32 dense TFLOP/s, memory GB). The one table must give every
# device name the same figures.
FORMER = {
    "B200": (2250.0, 2250.0, 1100.0, 180), "GH200": (989.0, 989.0, 494.0, 96),
    "H200": (989.0, 989.0, 494.0, 141), "H200 NVL": (835.0, 835.0, 417.0, 141),
    "H100 80GB": (989.0, 989.0, 494.0, 80), "H100 PCIe": (756.0, 756.0, 378.0, 80),
    "H100 NVL": (835.0, 835.0, 417.0, 94), "H800": (989.0, 989.0, 494.0, 80),
    "H800 PCIe": (756.0, 756.0, 378.0, 80), "A100 80GB": (312.0, 312.0, 156.0, 80),
    "A100 40GB": (312.0, 312.0, 156.0, 40), "L40S": (362.0, 362.0, 183.0, 48),
    "L40": (181.0, 181.0, 90.5, 48), "L4": (121.0, 121.0, 60.0, 24), "A10": (125.0, 125.0, 62.5, 24),
    "A10G": (125.0, 125.0, 62.5, 24), "V100 32GB": (None, 125.0, 15.7, 32),
    "V100 16GB": (None, 125.0, 15.7, 16), "T4": (None, 65.0, 8.1, 16),
}

# torch.cuda.get_device_name() of real cards -> (its kind, its model in the former table)
DEVICES = [
    ("NVIDIA H200", "h200", "H200"),
    ("NVIDIA H200 NVL", "h200-nvl", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm", "H100 80GB"),
    ("NVIDIA H100 PCIe", "h100-pcie", "H100 PCIe"),
    ("NVIDIA H100 NVL", "h100-nvl", "H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb", "A100 80GB"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb", "A100 80GB"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb", "A100 40GB"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb", "A100 40GB"),
    ("NVIDIA L40S", "l40s", "L40S"),
    ("NVIDIA L40", "l40", "L40"),
    ("NVIDIA L4", "l4", "L4"),
    ("NVIDIA A10", "a10", "A10"),
    ("NVIDIA A10G", "a10g", "A10G"),
    ("NVIDIA GH200 480GB", "gh200", "GH200"),
    ("NVIDIA H800", "h800", "H800"),
    ("NVIDIA H800 PCIe", "h800-pcie", "H800 PCIe"),
    ("NVIDIA B200", "b200", "B200"),
    ("Tesla V100-SXM2-16GB", "v100-16gb", "V100 16GB"),
    ("Tesla V100-PCIE-32GB", "v100-32gb", "V100 32GB"),
    ("Tesla T4", "t4", "T4"),
]


def memory_of(model: str) -> float:
    return FORMER[model][3]


@pytest.mark.parametrize("name,kind,model", DEVICES)
def test_device_names_name_exactly_one_kind(name, kind, model):
    """Each device name is one kind, whose peaks in every precision and memory are the former
    table's for that card (MFU and the memory check unchanged by the move into gpu_kinds.json)."""
    assert kind_of_device(name) == kind
    peaks = tuple(peak_tflops(name, p) for p in ("bf16", "fp16", "fp32"))
    assert peaks + (kinds()[kind].memory_gb,) == FORMER[model]


def test_every_model_of_the_former_table_has_a_device_here():
    assert {model for _, _, model in DEVICES} == set(FORMER)


def test_each_device_key_and_ray_label_belongs_to_one_place_in_the_table():
    """The table is the one home of a device's figures: no device key listed under two kinds
    (kind_of_device would depend on the order), every kind with a name a device or a label
    carries (but the 500 W variant, whose device name is unpublished), and a label's kind read
    from the same entries as its memory."""
    names = [d for k in kinds().values() for d in k.devices]
    assert len(names) == len(set(names))
    assert [k.key for k in kinds().values() if not k.devices + k.ray_labels] == ["h100-sxm-96gb-500w"]
    assert kind_of_label("AMD-Instinct-MI300X-OAM") == "mi300x" and label_memory_gb("AMD-Instinct-MI300X-OAM") == 192


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA GeForce RTX 4090",
                                  "NVIDIA RTX 6000 Ada Generation", "NVIDIA L4000",
                                  "NVIDIA A1000", ""])
def test_unknown_models_and_mig_slices_have_no_peak(name):
    assert kind_of_device(name) is None and peak_tflops(name) is None


@pytest.mark.parametrize("name,kind,model", DEVICES)
def test_an_fp32_run_is_measured_against_the_fp32_or_tf32_peak(name, kind, model):
    """MFU of an fp32 run against the bf16 peak would understate it by 2x (TF32) or more; a GPU
    without bf16 units is measured in fp16, which `precision auto` runs there."""
    fp32, fp16, bf16 = (peak_tflops(name, p) for p in ("fp32", "fp16", "bf16"))
    assert fp32 is not None and fp16 is not None
    assert fp32 < fp16 and (bf16 is None or fp32 < bf16)


@pytest.mark.parametrize("label,memory", [
    ("A100", None), ("H100", None), ("V100", None),  # kinds of different memory share these
    ("A100-80G", 80), ("A100-40G", 40),  # the labels Ray documents for adding by hand
    ("H200", 141), ("L40S", 48), ("L40", 48), ("L4", 24), ("A10G", 24), ("T4", 16),
    ("RTX-PRO-6000", None), ("B200", 180), ("GeForce-RTX-5090", None),
])
def test_ray_labels_give_memory_only_when_they_determine_it(label, memory):
    assert label_memory_gb(label) == memory


@pytest.mark.parametrize("name,kind,model", DEVICES)
def test_the_label_ray_derives_never_overstates_or_understates_memory(name, kind, model):
    """Whatever label Ray gives a node with this device, the driver's figure is its memory or
    none at all (then the worker checks the device itself)."""
    label = NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(name)
    memory = memory_of(model)
    sharing = {memory_of(m) for n, _, m in DEVICES
               if NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(n) == label}
    # its memory where every card of that label has the same (H200, L4, ...), else none (A100)
    assert label_memory_gb(label) == (memory if sharing == {memory} else None)


@pytest.mark.parametrize("name,kind,model", DEVICES)
def test_the_label_ray_derives_names_the_devices_kind_given_its_memory(name, kind, model):
    """`--layout auto` and the memory check take the kind from Ray's label and the memory per
    GPU; for every device here that is the device's own kind, but where two kinds share both
    label and memory (H100 SXM and PCIe, H200 and H200 NVL, H800 and H800 PCIe): then the first
    in the table, the SXM part."""
    label = NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(name)
    twins = {"h100-pcie": "h100-sxm", "h200-nvl": "h200", "h800-pcie": "h800"}
    assert kind_of_label(label, memory_of(model)) == twins.get(kind, kind)


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


def fake_device_memory(monkeypatch, total: float, name: str = "NVIDIA H100 80GB HBM3") -> None:
    """Without a GPU: the device properties torch would report for a card `name` of `total`
    bytes (the one call of torch.cuda that check_device_memory makes; get_device_name reads it)."""
    from types import SimpleNamespace

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: SimpleNamespace(total_memory=total, name=name))


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


MID = ["model.n_layer=24", "model.n_embd=2048", "model.n_head=16", "model.block_size=1024",
       "model.vocab_size=50304", "batch_size=16", "seq_len=1024"]


def test_a_gpu_workers_memory_check_plans_on_its_own_gpu_kind(monkeypatch):
    """The layout a worker's refusal suggests is ranked on the kind its device name is (a T4: its
    fp16 peak, PCIe links, one NIC per node), not on the H100's figures: on 8 T4s FSDP alone is
    the hint, where the H100's links would make it tp 2. Faked device properties, so it runs (and
    claims the same) on any host."""
    from types import SimpleNamespace

    from raytrain_lm.plan.fit import check_memory
    from raytrain_lm.worker.metrics import check_device_memory

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=16e9, name="Tesla T4"))
    cfg = build_config(flags=dict(use_gpu=True, workers=8), sets=MID)
    with pytest.raises(UserError) as worker:
        check_device_memory(cfg, torch.device("cuda", 0), force=False)
    with pytest.raises(UserError) as h100:
        check_memory(cfg, 16e9 / 2 ** 30)
    assert "try --tp 1 --pp 1 --strategy fsdp " in str(worker.value)
    assert "try --tp 2 " in str(h100.value)


def test_the_progress_line_shows_the_allocators_reservation_beside_the_allocated_peak():
    from raytrain_lm.results.tables import progress_line

    row = {"step": 4, "loss": 2.5, "lr": 1e-3, "tokens_per_second": 5e3, "data_wait_frac": 0.0,
           "peak_mem_gb": 10.0, "peak_mem_reserved_gb": 12.5, "step_time": 0.1}
    assert "mem 10.00 GB (12.50 reserved)" in progress_line(row, 10)
    assert "reserved" not in progress_line({**row, "peak_mem_reserved_gb": None}, 10)  # CPU
