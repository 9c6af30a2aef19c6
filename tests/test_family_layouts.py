"""The Llama-skeleton families (llama, qwen2, qwen3, mistral) on every layout, on the local harness
(local_mode.py: the unmodified loop on forked gloo ranks). The families are one decoder with
settings (models/llama/llama.py), so one model with every setting they add at once trains on
each layout: q/k/v biases (Qwen2: tp splits each with its rows), per-head q/k norms and a head
size other than width / heads (Qwen3: tp sums their gradients over the ranks' heads), a sliding
window shorter than the sequence (Mistral: the window mask), an output head tied to the
embedding (Llama 3.2, small Qwens: one parameter; a pipeline's first and last stage each hold a
copy, their gradients summed) and Llama 3.1's scaled rotary frequencies past the original
context. Each family's own model is one of its subsets (their logits against transformers:
test_families.py). A killed pipelined run resumes to the uninterrupted run's losses, bit for
bit."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import step_losses
from local_mode import Killed, run_local
from raytrain_lm.config.load import build_config
from raytrain_lm.models import build_model

STEPS = 6
GLOBAL_BATCH = 8  # sequences per step, whatever the layout
# 4 layers (the interleaved schedule needs 4 stages at --pp 2), 4 query heads of 32 (the width is
# 64) on 2 kv heads (one per tp rank); a window of 24 and an original context of 16 under the
# sequence of 48.
MODEL = ["model.arch=qwen3", "model.n_layer=4", "model.n_head=4", "model.n_kv_head=2",
         "model.n_embd=64", "model.head_size=32", "model.multiple_of=32", "model.block_size=64",
         "model.qkv_bias=true", "model.tie_embeddings=true", "model.sliding_window=24",
         "model.rope_type=llama3", "model.rope_factor=8", "model.rope_original_context=16"]
LAYOUTS = {  # name: (workers, flags); batch_size is per data-parallel rank
    "one": (1, {}),
    "ddp": (2, dict(strategy="ddp")),
    "zero1": (2, dict(strategy="zero1")),
    "zero2": (2, dict(strategy="zero2")),
    "fsdp": (2, dict(strategy="fsdp")),
    "tp2": (2, dict(tp=2)),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2-gpipe": (2, dict(pp=2, pp_schedule="gpipe", microbatches=4)),
    "pp2-1f1b": (2, dict(pp=2, pp_schedule="1f1b", microbatches=4)),
    "pp2-interleaved": (2, dict(pp=2, pp_schedule="interleaved-1f1b", microbatches=4)),
    "fsdp2xtp2": (4, dict(tp=2, strategy="fsdp")),
    "tp2xpp2": (4, dict(tp=2, pp=2, pp_schedule="1f1b", microbatches=4)),
}


def layout_config(data, storage, name, workers, flags, **more):
    dp = workers // (flags.get("tp", 1) * flags.get("pp", 1))
    return build_config(sets=MODEL, flags={**dict(
        workers=workers, max_steps=STEPS, batch_size=GLOBAL_BATCH // dp, seq_len=48, lr=3e-3,
        warmup_steps=2, log_every=1, eval_every=STEPS, eval_windows=16, checkpoint_every=-1,
        data=str(data),
        storage=str(storage), name=name, seed=5), **flags, **more})


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("family-layouts")


@pytest.fixture(scope="module")
def runs(pydoc_data, storage):
    """runs(name): that layout's (per-step losses, metrics rows), trained on first use."""
    done = {}

    def get(name):
        if name not in done:
            workers, flags = LAYOUTS[name]
            rows = []
            cfg = layout_config(pydoc_data, storage, name, workers, flags,
                                checkpoint_every=3 if name == "pp2-1f1b" else -1)  # the kill's
            summary = run_local(cfg, say=lambda m: None, on_metrics=rows.append)
            assert summary["status"] == "completed", name
            done[name] = (step_losses(storage / name), rows)
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "one"])
def test_every_layout_trains_the_families_model_as_one_worker_does(runs, layout):
    """Each step's loss and gradient norm within 1e-4 relative of one worker's (AdamW, clipping,
    warmup and cosine): the same initial values on every layout (the biases at zero and the
    q/k norms at one, filled shard by shard), the same windows, the same arithmetic."""
    (reference, one), (losses, rows) = runs("one"), runs(layout)
    assert losses.keys() == reference.keys() == set(range(1, STEPS + 1))
    for step in reference:
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    norms, want = ({r["step"]: r["grad_norm"] for r in rs if "grad_norm" in r} for rs in (rows, one))
    assert norms.keys() == want.keys() and len(want) == STEPS
    for step in want:
        assert norms[step] == pytest.approx(want[step], rel=1e-4), step
    assert rows[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_a_killed_pipelined_run_resumes_to_the_same_losses(runs, pydoc_data, storage):
    """pp2-1f1b (the tied embedding's two copies) killed after step 4, every rank at once:
    resumed from step 3's checkpoint, steps 4 to 6 are the uninterrupted run's, bit for bit."""
    workers, flags = LAYOUTS["pp2-1f1b"]
    cfg = layout_config(pydoc_data, storage, "pp2-killed", workers, flags, checkpoint_every=3,
                        log_seconds=1e-3)  # a report every step: the kill is after step 4's
    with pytest.raises(Killed):
        run_local(cfg, say=lambda m: None, kill_after=4)
    summary = run_local(build_config(base=cfg.to_dict()), resume=True, say=lambda m: None)
    assert summary["resumed_from_step"] == 3
    assert step_losses(storage / "pp2-killed") == runs("pp2-1f1b")[0]


@pytest.mark.slow
def test_a_tied_qwen2_folder_starts_a_pipelined_run_from_its_weights(pydoc_data, storage, tmp_path):
    """`train --init-from` a Hub-shaped Qwen2.5 folder (tied, q/k/v biases, bf16 shards): the
    model is the folder's config.json, and at --pp 2 (the embedding on the first stage, its copy
    under the head on the last) the first step's loss is transformers' on that step's batch."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from conftest import batches_as_read
    from raytrain_lm.store.hf_folder import folder_model
    from test_families import HUB, save_hub_folder

    save_hub_folder(tmp_path / "qwen", HUB["qwen2"], seed=1)
    flags = dict(workers=2, pp=2, pp_schedule="1f1b", microbatches=4, max_steps=1, batch_size=8,
                 seq_len=48, checkpoint_every=-1, eval_every=1, eval_windows=4, log_every=1,
                 data=str(pydoc_data), storage=str(storage), name="qwen-pp2", seed=5)
    cfg = build_config(flags=flags, folder=folder_model(tmp_path / "qwen"))
    assert (cfg.model.arch, cfg.model.tie_embeddings, cfg.model.qkv_bias) == ("qwen2", True, True)
    run_local(cfg, init_from=str(tmp_path / "qwen"), say=lambda m: None)
    x, y = batches_as_read(cfg).next()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.reshape(-1)).item()
    assert step_losses(storage / "qwen-pp2")[1] == pytest.approx(expected, rel=1e-5, abs=1e-5)


# ---------------------------------------------------------------- gradients under tensor parallelism
# The losses above hardly move when one small parameter's gradient is wrong (AdamW's steps are
# nearly the gradient's sign): every gradient is compared here, on two gloo ranks.


def _tp_grads(rank, port, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from raytrain_lm.parallel.tp import apply_tp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]
    m, x = _tp_case()
    grads = {}
    for sp in (False, True):
        model = build_model(m, seed=3)
        apply_tp(model, mesh, sequence_parallel=sp)
        with loss_parallel():
            model(x, x)[1].backward()
        grads[sp] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                     for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out)
    dist.destroy_process_group()


def _tp_case():
    m = build_config(sets=[*MODEL, "model.vocab_size=320"], flags={"seq_len": 48}).model
    return m, torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_tensor_parallelism_gives_every_gradient_of_one_process(tmp_path):
    """tp 2, without and with sequence parallelism: every parameter's gradient (the q/k/v biases
    split with their rows, the q/k norms' summed over the ranks' heads, the tied embedding's
    from both its uses) is one process's, to float rounding."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_tp_grads, args=(port, tmp_path / "grads.pt"), nprocs=2, start_method="fork")
    m, x = _tp_case()
    model = build_model(m, seed=3)
    model(x, x)[1].backward()
    for sp, grads in torch.load(tmp_path / "grads.pt").items():
        assert grads.keys() == dict(model.named_parameters()).keys()
        assert {"h.0.attn.q_norm.weight", "h.0.attn.q_proj.bias"} <= grads.keys()
        for name, p in model.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-7), (sp, name)
