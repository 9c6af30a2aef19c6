"""--param mup (models/mup.py): every family's parameter groups, multipliers and initial scales
against the muP table for Adam (Tensor Programs V, Table 3; `mup.MuAdamW`), the optimizer's
groups and the step's learning rates, the checks, and --init-from's refusal."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model, mup
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.worker.optim import build_optimizer

BASE, WIDTH = 32, 64  # the base width, and a model twice as wide
FAMILIES = {
    "gpt": dict(arch="gpt"),
    "llama": dict(arch="llama", n_kv_head=2, ffn_dim=128),
    "qwen2": dict(arch="qwen2", n_kv_head=2, ffn_dim=128, qkv_bias=True, tie_embeddings=True),
    "qwen3": dict(arch="qwen3", n_kv_head=2, ffn_dim=128, qk_norm=True),
    "mistral": dict(arch="mistral", n_kv_head=2, ffn_dim=128, sliding_window=4),
    "moe": dict(arch="moe", n_kv_head=2, n_experts=4, top_k=2, ffn_dim=32, shared_ffn_dim=32),
}
# The hidden matrices (both dims follow the width) by the last step of their names.
HIDDEN = ("c_attn.weight", "c_proj.weight", "c_fc.weight", "q_proj.weight", "k_proj.weight",
          "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
          "down_proj.weight", "experts.gate_proj", "experts.up_proj", "experts.down_proj")


def config(arch: str, width: int = WIDTH, param: str = "mup") -> ModelConfig:
    return ModelConfig(vocab_size=48, block_size=8, n_layer=2, n_head=4, n_embd=width,
                       param=param, mup_base_width=BASE if param == "mup" else None,
                       **FAMILIES[arch])


def expected(name: str) -> tuple[float, float, float]:
    """(lr, weight decay, init) multiples of the table at width WIDTH = 2 x BASE."""
    if name.endswith(HIDDEN):  # fan_in twice the base's: lr 1/2, decay x2 (lr x wd kept), var 1/2
        return 0.5, 2.0, 1 / math.sqrt(2)
    if name.startswith("ln_f."):  # the output logits' base/width, folded into the final norm
        return 0.5, 1.0, 0.5
    if name.endswith("router.weight"):  # a readout: base/width in lr and init (Table 3's form)
        return 0.5, 2.0, 0.5
    return 1.0, 1.0, 1.0  # embeddings, the head, biases, norms: width-independent


@pytest.mark.parametrize("arch", FAMILIES)
def test_mup_rules_initial_values_and_groups_follow_the_table(arch):
    """Per family: each parameter's rule is the table's; its initial values are the sp model's
    (same seed: the same draws) times the rule's init factor, the final norm's gain the output
    multiplier; the optimizer puts it in a group of the table's lr multiple and decay."""
    m = config(arch)
    mup.check(m)
    sp = dict(build_model(config(arch, param="sp"), seed=3).named_parameters())
    model = build_model(m, seed=3)
    for name, p in model.named_parameters():
        lr, wd, init = expected(name)
        r = mup.rule(m, name)
        assert (r.lr, r.wd) == pytest.approx((lr, wd)), name
        if name == "ln_f.weight":
            assert torch.equal(p, torch.full_like(p, init))
        else:
            torch.testing.assert_close(p, sp[name] * init, rtol=1e-6, atol=0, msg=name)
    optimizer = build_optimizer(model, TrainConfig(model=m, weight_decay=0.1), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    for group, mult in zip(optimizer.param_groups, optimizer.lr_mults, strict=True):
        assert "lr_mult" not in group  # the state dict keeps the keys a run saved before muP has
        for p in group["params"]:
            lr, wd, _ = expected(names[id(p)])
            assert mult == pytest.approx(lr), names[id(p)]
            assert group["weight_decay"] == pytest.approx(0.1 * wd if p.dim() >= 2 else 0.0)


@pytest.mark.parametrize("arch", ["gpt", "qwen3"])
def test_mup_attention_is_one_over_d(arch):
    """Under mup q.k is scaled by sqrt(d_base)/d: the mup model computes the sp model given the
    same weights with its queries multiplied by sqrt(d_base/d) (1/sqrt(d) x that = the scale);
    the GPT's queries are c_attn's q rows, Qwen3's the q_norm gain (its queries are normalised
    after the projection)."""
    m = config(arch)
    model = build_model(m, seed=0)
    sp = build_model(dataclasses.replace(m, param="sp", mup_base_width=None), seed=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    c = math.sqrt((BASE // m.n_head) / m.head_dim)
    if arch == "gpt":  # rows [h0 q, h0 k, h0 v, h1 q, ...] of head_dim each
        for name in [k for k in state if k.endswith("c_attn.weight") or k.endswith("c_attn.bias")]:
            view = state[name].view(m.n_head, 3, m.head_dim, -1)
            view[:, 0] *= c
    else:
        for name in [k for k in state if k.endswith("q_norm.weight")]:
            state[name] *= c
    sp.load_state_dict(state)
    idx = torch.randint(0, m.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(model(idx, idx)[0], build_model(
        dataclasses.replace(m, param="sp", mup_base_width=None), seed=0)(idx, idx)[0])
    torch.testing.assert_close(model(idx, idx)[0], sp(idx, idx)[0], rtol=1e-5, atol=1e-5)


def test_mup_at_its_base_width_is_sp():
    """At the base width every multiplier is 1 and 1/d is 1/sqrt(d): the same model."""
    m = config("llama", width=BASE)
    sp = dataclasses.replace(m, param="sp", mup_base_width=None)
    idx = torch.randint(0, m.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    a, b = build_model(m, seed=0), build_model(sp, seed=0)
    assert torch.equal(a(idx, idx)[0], b(idx, idx)[0])
    assert set(build_optimizer(a, TrainConfig(model=m), torch.device("cpu")).lr_mults) == {1.0}


def test_a_parameter_keeps_its_group_under_wrappers_and_stages():
    """The rule is looked up by the parameter's role: DDP's `module.`, compile's `_orig_mod.`,
    activation checkpointing's wrapper and a pipeline stage's names find the decoder's rule; a
    name the model lacks is an error, never a guessed group."""
    m = config("gpt")
    plain = mup.rule(m, "h.1.mlp.c_fc.weight")
    for name in ("module.h.1.mlp.c_fc.weight", "_orig_mod.h.1.mlp.c_fc.weight",
                 "h.1._checkpoint_wrapped_module.mlp.c_fc.weight"):
        assert mup.rule(m, name) == plain
    assert mup.rule(m, "lm_head.weight") == mup.rule(m, "wte.weight")  # tied
    with pytest.raises(KeyError):
        mup.rule(m, "h.7.mlp.c_fc.weight")


def test_the_step_runs_each_group_at_its_lr():
    """TrainStep sets each group's lr to the schedule's times its multiplier: after one step
    (Adam's first update is lr x sign(g), no decay) a hidden matrix moved by lr/2, the
    embedding by lr."""
    from raytrain_lm.worker.step import TrainStep

    cfg = TrainConfig(model=config("gpt"), weight_decay=0.0, grad_clip=1e6, batch_size=2,
                      seq_len=8)
    step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda model: model)
    model = step.parts[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    class Batches:
        def next(self):
            x = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(0))
            return x, torch.roll(x, -1, 1)

    step.train()
    step(Batches(), 1e-3)
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    assert moved["h.0.mlp.c_fc.weight"] == pytest.approx(0.5e-3, rel=1e-3)
    assert moved["wte.weight"] == pytest.approx(1e-3, rel=1e-3)


def router_logit_update(width: int, param: str) -> float:
    """Mean |change| of block 0's router logits on a fixed input after one AdamW step (lr 1e-2,
    no decay) of a moe model at `width` (mup base: BASE)."""
    m = dataclasses.replace(config("moe", width=width, param=param), n_layer=1,
                            ffn_dim=width // 2, shared_ffn_dim=0)
    model = build_model(m, seed=0)
    seen = []
    model.h[0].mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    idx = torch.randint(0, m.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    before = model.h[0].mlp.router.weight.detach().clone()
    optimizer = build_optimizer(model, TrainConfig(model=m, weight_decay=0.0), torch.device("cpu"))
    for group, mult in zip(optimizer.param_groups, optimizer.lr_mults):
        group["lr"] = 1e-2 * mult
    model(idx, torch.roll(idx, -1, 1))[1].backward()
    optimizer.step()
    x = seen[0].reshape(-1, width)
    return (x @ (model.h[0].mlp.router.weight.detach() - before).T).abs().mean().item()


def test_a_router_is_a_readout_its_logits_update_does_not_grow_with_the_width():
    """A router maps the width to the experts: a readout, which muP gives a 1/width multiplier
    (here: init and Adam lr x base/width). Adam's first step moves each weight by ~lr whatever
    its gradient's scale, and the router's input coordinates are Theta(1) and correlated with
    that step, so without the rule its logits' update grows ~width (x4 from width 32 to 128,
    sp's measured ratio below); with it, flat. The bound 2 is the geometric middle of flat (1)
    and linear growth (4); measured: mup 0.8, sp 3.8, mup without the rule 3.2."""
    mup_ratio = router_logit_update(4 * BASE, "mup") / router_logit_update(BASE, "mup")
    sp_ratio = router_logit_update(4 * BASE, "sp") / router_logit_update(BASE, "sp")
    assert mup_ratio < 2.0 < sp_ratio, (mup_ratio, sp_ratio)


def test_init_std_is_the_base_widths_std_and_mup_rescales_it():
    """model.init_std is the std of the matrices' and the embedding's draws (the residual
    projections' / sqrt(2 n_layer)); under mup a hidden matrix's is it / sqrt(width / base)."""
    m = dataclasses.replace(config("gpt", width=4 * BASE), init_std=0.05, vocab_size=256)
    params = dict(build_model(m, seed=0).named_parameters())
    # the sample std of n >= 8192 normal draws is within 3 x 1/sqrt(2n) < 2.4% of the true one
    assert params["wte.weight"].std().item() == pytest.approx(0.05, rel=0.024)
    assert params["h.0.mlp.c_fc.weight"].std().item() == pytest.approx(0.05 / 2, rel=0.024)
    assert params["h.0.mlp.c_proj.weight"].std().item() == pytest.approx(0.05 / 2 / 2, rel=0.024)
    from raytrain_lm.config.checks import check_model

    with pytest.raises(UserError, match="model.init_std must be positive"):
        check_model(dataclasses.replace(m, init_std=0.0))


def test_mup_zero_init_zeroes_the_queries_and_an_untied_head_on_any_layout():
    """model.mup_zero_init (muP paper's recommendation, `mup`'s readout_zero_init): the query
    projection and an untied head start at zero, every other parameter keeps its draws; GPT's
    fused c_attn by its query rows, also when a shard's region starts inside a head (tensor
    parallelism), and a tied head (the embedding) is not zeroed. The untied model's logits at
    init are then zero."""
    from raytrain_lm.models.decoder import init_region_

    for arch, zeroed in (("gpt", ()), ("llama", ("q_proj.weight", "lm_head.weight")),
                         ("qwen2", ("q_proj.weight", "q_proj.bias"))):
        m = config(arch)
        plain = dict(build_model(m, seed=3).named_parameters())
        zm = dataclasses.replace(m, mup_zero_init=True)
        model = build_model(zm, seed=3)
        for name, p in model.named_parameters():
            if name.endswith(zeroed):
                assert not p.any(), name
            elif name.endswith("c_attn.weight"):
                rows = p.view(m.n_head, 3, m.head_dim, -1)
                assert not rows[:, 0].any() and rows[:, 1:].abs().min() > 0
                torch.testing.assert_close(rows[:, 1:], plain[name].view_as(rows)[:, 1:], rtol=0, atol=0)
            else:
                torch.testing.assert_close(p, plain[name], rtol=0, atol=0, msg=name)
        if arch == "llama":
            idx = torch.randint(0, m.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
            assert not model(idx)[0].any()
    m = dataclasses.replace(config("gpt"), mup_zero_init=True)
    spec = mup.init_spec(m, "h.0.attn.c_attn.weight", ("normal", 0.02))
    full = torch.empty(3 * m.n_embd, m.n_embd)
    init_region_(full, "h.0.attn.c_attn.weight", spec, full.shape, (0, 0), seed=5)
    part = torch.empty(70, m.n_embd)  # rows 41..110: starts and ends inside heads
    init_region_(part, "h.0.attn.c_attn.weight", spec, full.shape, (41, 0), seed=5)
    assert torch.equal(part, full[41:111])


@pytest.mark.parametrize("change, message", [
    (dict(param="mu"), "model.param must be one of sp, mup"),
    (dict(param="sp"), "model.mup_base_width is a setting of --param mup"),
    (dict(param="sp", mup_base_width=None, mup_zero_init=True), "model.mup_zero_init is a setting"),
    (dict(mup_base_width=30), "must be a positive multiple of model.n_head"),
    (dict(arch="llama", multiple_of=256), "does not follow the width"),
])
def test_mup_settings_are_checked(change, message):
    m = dataclasses.replace(config("gpt"), **change)
    with pytest.raises(UserError, match=message):
        mup.check(m)


def test_init_from_a_hugging_face_folder_refuses_mup():
    """A folder's weights are sp's: --param mup with --init-from a folder is refused, naming why."""
    from raytrain_lm.config.load import build_config

    fields = {"arch": "llama", "bias": False, "n_layer": 2, "n_head": 4, "n_embd": 64,
              "vocab_size": 48}
    assert build_config(folder=("--init-from hf", fields)).model.param == "sp"
    with pytest.raises(UserError, match="trained in the standard parametrization"):
        build_config(sets=["model.param=mup"], folder=("--init-from hf", fields))


def test_a_mup_model_is_not_exported_to_hugging_face(tmp_path):
    """Hugging Face's classes compute attention with 1/sqrt(d): a mup model (1/d) would load
    there as another model. Refused before anything is written."""
    from raytrain_lm.data.tokenizer import ByteTokenizer
    from raytrain_lm.results.hf_export import export_hf

    m = dataclasses.replace(config("llama"), vocab_size=256)
    with pytest.raises(UserError, match="--format native"):
        export_hf(build_model(m, seed=0).state_dict(), m, ByteTokenizer(), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_coordinate_check_is_flat_under_mup_and_grows_under_sp():
    """bench/mup_coord_check.py at widths 64, 128, 256 after two Adam steps at lr 1e-2: the slope
    of log2(mean |coordinate|) against log2(width), per layer, of the activations and of their
    change since initialisation. muP keeps every coordinate Theta(1): slope 0 as the width grows.
    A wrong rule shows as a slope of 1/2 or 1 (an init std without 1/sqrt(fan_in): 1/2; a hidden
    lr without 1/width or logits without base/width: 1, as sp's updates grow), so a bound of 1/4
    tells a right parametrization from one wrong rule, above the finite-width deviation measured
    at these widths (|slope| <= 0.13 at 64-256; <= 0.09 at 32-256 with longer runs:
    docs/benchmarks.md). sp's block outputs and logits grow at >= 1/2 (measured 0.8 to 2). Each
    rule broken alone, measured here: hidden lr not divided, 1.7; init std not divided, 0.40;
    output multiplier left out, 0.64."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from mup_coord_check import LAYERS, coord_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    result = coord_check([64, 128, 256], steps=2, lr=1e-2, seeds=1, batch=2, seq=16, depth=1)
    for name in LAYERS:
        for kind in ("size", "update"):
            assert abs(result["param"]["mup"][name]["slope"][kind][-1]) <= 0.25, (name, kind)
    for name in ("block0.attn", "block0.mlp", "block_last", "logits"):
        assert result["param"]["sp"][name]["slope"]["update"][-1] >= 0.5, name


def test_a_tuned_proxy_transfers_to_the_target_width_through_train_config(tmp_path):
    """transfer.yaml (tune --target-width) is the proxy's config at the target width, the base
    width kept at the proxy's: `train --config` builds it as the target model, whose hidden
    matrices then run at the proxy's lr x proxy/target and its embedding at the proxy's."""
    from raytrain_lm.config.load import build_config
    from raytrain_lm.tune.transfer import transfer_yaml

    proxy = build_config(flags=dict(lr=0.01, warmup_steps=7),
                         sets=["model.param=mup", "model.n_embd=64", "model.n_head=4"])
    path = tmp_path / "transfer.yaml"
    path.write_text(transfer_yaml(proxy.to_dict(), 256, "sweep", "trial_1"))
    target = build_config(config_file=str(path))
    assert (target.model.n_embd, target.model.mup_base_width, target.model.param) == (256, 64, "mup")
    assert (target.lr, target.warmup_steps, target.model.n_layer) == (0.01, 7, proxy.model.n_layer)
    assert mup.rule(target.model, "h.0.mlp.c_fc.weight").lr == pytest.approx(64 / 256)
    assert mup.rule(target.model, "wte.weight").lr == 1.0


def test_train_refuses_an_unknown_param_in_one_line(tmp_path):
    from conftest import cli_here
    from test_cli_errors import assert_clean_error

    result = cli_here("train", "--param", "mu", "--storage", str(tmp_path / "runs"),
                      env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert_clean_error(result, "model.param must be one of sp, mup")
    assert not (tmp_path / "runs").exists()
