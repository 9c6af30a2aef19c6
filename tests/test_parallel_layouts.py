"""The three paradigms over gloo on the local harness (local_mode.py: the same loop on forked gloo
ranks): every layout trains the same model as one worker does, step for step, and reports what
it holds and moves; a Hugging Face Llama starts them; checkpoints move between layouts; layouts
that cannot work are refused. On Ray Train workers: test_parallel.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import LLAMA_SETTINGS, batches_as_read, cli_here, save_hf_llama, step_losses, validation_as_read
from local_mode import run_local
from raytrain_lm.config.load import build_config

STEPS = 14
GLOBAL_BATCH = 16  # sequences per step, whatever the layout
# 4 layers, 4 heads (2 per tp rank), no dropout: the same math in every layout, up to float
# rounding.
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=64", "model.block_size=64",
         "model.dropout=0"]
# Two pipeline schedules and sequence parallelism, composed where a layout can carry them (the
# interleaved schedule, model-agnostic: test_virtual_stages.py and test_family_layouts.py).
LAYOUTS = {  # name: (workers, flags); batch_size is per data-parallel rank
    "one": (1, {}),
    "tp2": (2, dict(tp=2)),
    "pp2-1f1b": (2, dict(pp=2, pp_schedule="1f1b", microbatches=4)),
    "dp2xpp2-gpipe": (4, dict(pp=2, strategy="ddp", pp_schedule="gpipe", microbatches=4)),
    "fsdp2xtp2-sp": (4, dict(tp=2, strategy="fsdp", sequence_parallel=True)),
}
# The Llama (same width, 2 kv heads: one per tp rank) at tp 2 (q/k/v and gate/up column-wise,
# whole kv heads per rank), both runs from one Hugging Face Llama folder made by transformers
# (--init-from). The Llama skeleton on every other layout: test_family_layouts.py; the import
# into fsdp, tp and pp shards, tensor by tensor: test_hf_load.py.
ARCHS = {
    "gpt": (MODEL, LAYOUTS),
    "llama": (MODEL + LLAMA_SETTINGS, {k: LAYOUTS[k] for k in ("one", "tp2")}),
}


def layout_config(data, storage, name, workers, flags, arch="gpt", **more):
    dp = workers // (flags.get("tp", 1) * flags.get("pp", 1))
    return build_config(sets=ARCHS[arch][0], flags={**dict(
        workers=workers, cpus_per_worker=0.5 if workers > 2 else 1.0, max_steps=STEPS,
        batch_size=GLOBAL_BATCH // dp, seq_len=64, lr=3e-3, warmup_steps=5, log_every=10,
        eval_every=STEPS, checkpoint_every=10 if name.endswith("tp2") else 0,  # tp2's: the resume tests
        data=str(data), storage=str(storage), name=name, seed=5), **flags, **more})


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, pydoc_data, storage):
    return hf_llama(tmp_path_factory.mktemp("hf-llama"), pydoc_data, storage)


def hf_llama(folder, data, storage):
    """A Hugging Face Llama of the Llama runs' shape, with the byte tokenizer, saved in `folder`
    by transformers: (folder, model)."""
    from raytrain_lm.data.manifest import load_manifest
    from raytrain_lm.data.vocab import byte_tokenizer_json
    from raytrain_lm.run.preflight import fit_model_to_data

    cfg = layout_config(data, storage, "shape", 1, {}, arch="llama")
    fit_model_to_data(cfg, load_manifest(data))
    return folder, save_hf_llama(folder, cfg.model, byte_tokenizer_json().encode(), seed=7)


def run_name(arch, name):
    return name if arch == "gpt" else f"llama-{name}"


@pytest.fixture(scope="module")
def runs(pydoc_data, storage, request):
    """runs(arch): every layout's per-step losses and metrics rows (one run each on the harness,
    made on first use)."""
    done = {}

    def get(arch):
        if arch not in done:
            init_from = str(request.getfixturevalue("hf_folder")[0]) if arch == "llama" else None
            done[arch] = {}
            for name, (workers, flags) in ARCHS[arch][1].items():
                done[arch][name] = run_layout(pydoc_data, storage, run_name(arch, name), workers, flags,
                                              arch, init_from)
        return done[arch]

    return get


def run_layout(data, storage, name, workers, flags, arch="gpt", init_from=None, train=run_local):
    """One layout's run (on the harness, or with `train=run_training` on Ray): its per-step
    losses and metrics rows."""
    return run_config(layout_config(data, storage, name, workers, flags, arch), init_from, train)


def run_config(cfg, init_from=None, train=run_local):
    """The run of `cfg` (on the harness, or with `train=run_training` on Ray), completed: its
    per-step losses and metrics rows."""
    rows = []
    summary = train(cfg, init_from=init_from, say=lambda m: None, on_metrics=rows.append)
    assert summary["status"] == "completed", cfg.name
    return step_losses(Path(cfg.storage) / cfg.name), rows


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [(a, n) for a in ARCHS for n in ARCHS[a][1] if n != "one"])
def test_every_layout_trains_the_one_worker_model(runs, arch, layout):
    """Within 1e-4 relative at each of 14 steps (AdamW, clipping, warmup and cosine): the same
    initial weights (built sharded, filled with the values one process would draw, or the same
    Hugging Face weights loaded into each rank's shards), the same windows (sharded by
    data-parallel rank only), the same global gradient norm."""
    assert_trains_the_one_worker_model(runs(arch)[layout], runs(arch)["one"])


def assert_trains_the_one_worker_model(run, one_worker):
    """`run` and `one_worker`: (per-step losses, metrics rows) of a layout and of one worker."""
    (losses, rows), (reference, one) = run, one_worker
    assert losses.keys() == reference.keys() == set(range(1, STEPS + 1))
    for step in reference:
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    # the norm before clipping, of each reported step: losses alone hide a constant factor on the
    # gradient (AdamW's update ignores it), such as a pipeline that does not divide by its
    # microbatches, or replicated weights' gradients summed over tp ranks
    assert [r["step"] for r in rows] == [r["step"] for r in one]
    for row, ref in zip(rows, one):
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), row["step"]
    assert rows[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-4)
    # bits per byte counts each data-parallel group's text once, not once per tp rank or stage
    # (bytes: exactly val_loss / ln 2)
    assert rows[-1]["val_bpb"] == pytest.approx(rows[-1]["val_loss"] / math.log(2), rel=1e-9)


@pytest.mark.slow
def test_the_layouts_report_what_they_hold_and_move(runs):
    """tp2 holds half the parameters per rank, its tp dimension moves bytes, the pipelines
    report a bubble and point-to-point bytes; DDP replicas agree; built sharded, FSDP2 x TP2
    holds a quarter."""
    tp2, pp2, one = runs("gpt")["tp2"][1][-1], runs("gpt")["pp2-1f1b"][1][-1], runs("gpt")["one"][1][-1]
    assert one["param_fraction"] == 1.0 and one["comm_bytes"] == {}
    assert tp2["param_fraction"] == pytest.approx(0.5, abs=0.03)  # norms stay replicated
    assert tp2["comm_bytes"]["tp"] > 0 and "pp" not in tp2["comm_bytes"]
    assert pp2["comm_bytes"]["pp"] > 0 and 0.0 < pp2["bubble"] < 1.0
    both = runs("gpt")["fsdp2xtp2-sp"][1][-1]
    assert both["comm_bytes"]["dp"] > 0 and both["param_fraction"] == pytest.approx(0.25, abs=0.02)


@pytest.mark.slow
def test_the_data_parallel_layouts_carry_the_noise_scale_in_their_rows(runs):
    """Through the loop on the harness: the layouts with two dp ranks (replicate over pp, FSDP2
    over tp with sequence parallelism) carry the noise scale's fields in every row, from b = one
    dp rank's batch (their values against the one-process formula: test_noise_worker.py); those
    with one dp rank and no accumulation carry none."""
    for name in ("dp2xpp2-gpipe", "fsdp2xtp2-sp"):
        for row in runs("gpt")[name][1]:
            assert math.isfinite(row["noise_grad_sq"]) and math.isfinite(row["noise_trace"]), name
            assert "noise_scale" in row
    for name in ("one", "tp2", "pp2-1f1b"):
        assert not any("noise_grad_sq" in row for row in runs("gpt")[name][1]), name


@pytest.mark.slow
def test_a_llama_starts_from_the_hf_models_weights(runs, hf_folder, pydoc_data, storage):
    """--init-from a Hugging Face Llama folder: the first step's loss is the transformers
    model's loss on that step's batch (the same windows, read here as the run read them)."""
    import torch.nn.functional as F

    cfg = layout_config(pydoc_data, storage, "x", 1, {}, arch="llama")
    x, y = batches_as_read(cfg).next()
    with torch.no_grad():
        logits = hf_folder[1](x).logits
    expected = F.cross_entropy(logits.flatten(0, 1), y.reshape(-1)).item()
    assert runs("llama")["one"][0][1] == pytest.approx(expected, rel=1e-5, abs=1e-5)


@pytest.mark.slow
def test_a_sharded_llama_checkpoint_loads_in_one_process(runs, storage, pydoc_data):
    """The tp2 run's final checkpoint (two ranks' shards, dcp/) gathered in one process, as
    generate and export load it: its validation loss on the run's validation windows is the one
    the run measured at tp2."""
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.data.loaders import Validation
    from raytrain_lm.data.tokenizer import ByteTokenizer
    from raytrain_lm.models import decoder_class
    from raytrain_lm.store.checkpoint_format import load_checkpoint

    state = load_checkpoint(storage / "llama-tp2" / f"checkpoint_{STEPS:08d}")
    cfg = TrainConfig.from_dict(state["config"])
    model = decoder_class(cfg.model).from_state_dict(cfg.model, state["model"]).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in validation_as_read(cfg, ByteTokenizer().text_byte_lengths()):
            n = int((y != Validation.IGNORE).sum())
            total += model(x, y)[1].item() * n
            tokens += n
    assert total / tokens == pytest.approx(runs("llama")["tp2"][1][-1]["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_tp2_checkpoint_resumes_as_fsdp_on_two_workers(runs, storage, pydoc_data):
    """Saved at --tp 2 (one data-parallel rank of 16 sequences), continued at --strategy fsdp
    --workers 2 (two ranks of 8): the next step's loss is the uninterrupted tp2 run's."""
    shutil.copytree(storage / "tp2", storage / "tp2-to-fsdp")
    torn = storage / "tp2-to-fsdp" / f"checkpoint_{STEPS:08d}" / "state.pt"
    torn.write_bytes(torn.read_bytes()[:100])  # the final checkpoint is skipped: resume from 10
    cfg = build_config(base=json.loads((storage / "tp2-to-fsdp" / "config.json").read_text()),
                       flags={"tp": 1, "strategy": "fsdp", "batch_size": GLOBAL_BATCH // 2,
                              "max_steps": 12})
    cfg.name = "tp2-to-fsdp"
    rows = []
    summary = run_local(cfg, resume=True, say=lambda m: None, on_metrics=rows.append)
    assert summary["resumed_from_step"] == 10
    resumed, uninterrupted = step_losses(storage / "tp2-to-fsdp"), runs("gpt")["tp2"][0]
    for step in (11, 12):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step


@pytest.mark.parametrize("args,expected", [
    (["--worker-env", "NOEQUALS"], "--worker-env expects KEY=VALUE"),
    (["--tp", "3", "--workers", "3"], "model.n_head (4) must be divisible by --tp 3"),
    (["--pp", "8", "--workers", "8"], "model.n_layer (4) is fewer than the 8 pipeline stages"),
    (["--workers", "3", "--tp", "2"], "--workers 3 must be a multiple of --tp x --pp = 2"),
    (["--pp", "2", "--microbatches", "1"], "--microbatches 1 is fewer than the 2 pipeline stages"),
    (["--pp", "2", "--microbatches", "3"], "--batch-size 16 must be divisible by --microbatches 3"),
    (["--pp", "2", "--grad-accum", "2"], "use them instead of --grad-accum"),
    (["--pp", "2", "--pp-schedule", "zigzag"], "--pp-schedule must be one of"),
    (["--sequence-parallel"], "--sequence-parallel needs --tp 2 or more"),
    (["--preset", "llama-tiny", "--workers", "4", "--tp", "4"],
     "model.n_kv_head (2) must be divisible by --tp 4: each tensor-parallel rank holds whole key/value heads"),
    (["--preset", "llama-tiny", "--set", "model.n_kv_head=3"], "model.n_kv_head (3) must divide model.n_head (4)"),
    (["--arch", "llama", "--set", "model.bias=true"], "the Llama has no biases"),
    (["--arch", "llama", "--set", "model.dropout=0.1"], "the Llama has no dropout"),
    (["--arch", "mamba"], "model.arch must be one of gpt, llama"),
])
def test_layouts_that_cannot_work_are_refused(tmp_path, args, expected):
    from test_cli_errors import assert_clean_error

    result = cli_here("train", "--storage", str(tmp_path / "runs"), *args)
    assert_clean_error(result, expected)
    assert not (tmp_path / "runs").exists()
