"""The step (worker/step.TrainStep) in this process, without Ray: what it keeps alive."""

from __future__ import annotations

import weakref

import pytest
import torch

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.worker.step import TrainStep


class Batches:
    def __init__(self, vocab: int, batch: int, seq: int):
        self.g, self.shape, self.vocab = torch.Generator().manual_seed(0), (batch, seq), vocab

    def next(self):
        x = torch.randint(self.vocab, self.shape, generator=self.g)
        return x, torch.roll(x, -1, 1)


def test_the_logits_are_freed_before_the_backward():
    """The forward's logits (batch x seq x vocab, the largest activation of a small model) are
    not needed by the backward (cross-entropy keeps its own log-softmax): the step holds only
    the loss, so they are gone by the time the first gradient arrives."""
    cfg = TrainConfig()
    cfg.batch_size, cfg.seq_len, cfg.grad_accum = 2, 16, 2
    m = cfg.model
    m.vocab_size, m.n_layer, m.n_embd, m.n_head, m.block_size = 64, 1, 32, 2, 16
    step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda model: model)
    model = step.parts[0]
    logits: list[weakref.ref] = []
    alive_in_backward: list[bool] = []
    model.register_forward_hook(lambda mod, args, out: logits.append(weakref.ref(out[0])))
    for p in model.parameters():
        p.register_hook(lambda g: alive_in_backward.append(logits[-1]() is not None) or g)
    step.train()
    step(Batches(m.vocab_size, cfg.batch_size, cfg.seq_len), 1e-3)
    assert len(logits) == 2 and alive_in_backward and not any(alive_in_backward)


class Halves:
    """The batches of `whole`, each served as its two halves: --grad-accum 2 of half the batch."""

    def __init__(self, whole: Batches):
        self.whole, self.held = whole, []

    def next(self):
        if not self.held:
            x, y = self.whole.next()
            self.held = [(x[4:], y[4:]), (x[:4], y[:4])]
        return self.held.pop()


def test_accumulation_gives_the_whole_batchs_gradient_norm_and_update():
    """Two micro-batches of 4 sequences give the gradient of one batch of 8: the same loss, the
    same norm (what each metrics row reports) and the same parameters after each step. The
    losses alone did not show a step that forgot to divide by the micro-batches (AdamW's update
    does not change with a constant factor on the gradient, and clipping hides it): the norm
    doubles.

    In float64, so that the two sides differ only by the order of float64 sums: each gradient
    entry is a sum over at most 128 token positions, whose rounding is at most 128 * 2**-53
    (1.4e-14) of the sum of its terms' sizes. The loss (a mean of 128 positive terms) and the
    norm (a sum of squares) have no cancellation: 1e-12 relative is 70 times that bound. AdamW
    divides a gradient's error by sqrt(v) + eps >= eps = 1e-8 and multiplies it by lr = 1e-3:
    at most 1e-14 / 1e-8 * 1e-3 = 1e-9 per step for terms of size <= 1, so the parameters must
    agree to 3e-9 after 3 steps (a millionth of an lr step each), where a lost or repeated
    micro-batch moves them by about an lr step (1e-3). In float32 the same bound is 2**29 times
    larger, as large as the step itself: the float32 run agreed to 1e-6 on one machine and not on
    another (issue 48)."""
    def step_of(batch: int, accum: int) -> TrainStep:
        cfg = TrainConfig()
        cfg.batch_size, cfg.seq_len, cfg.grad_accum, cfg.seed = batch, 16, accum, 0
        m = cfg.model
        m.vocab_size, m.n_layer, m.n_embd, m.n_head, m.block_size, m.dropout = 64, 1, 32, 2, 16, 0.0
        step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda model: model)
        step.parts[0].double()  # in place: the optimizer holds the same parameters
        step.train()
        return step

    whole, halves = step_of(8, 1), step_of(4, 2)
    data_whole, data_halves = Batches(64, 8, 16), Halves(Batches(64, 8, 16))
    for _ in range(3):
        loss_w, norm_w = whole(data_whole, 1e-3)
        loss_h, norm_h = halves(data_halves, 1e-3)
        assert loss_w.dtype == norm_w.dtype == torch.float64
        assert loss_h.item() == pytest.approx(loss_w.item(), rel=1e-12, abs=0)
        assert norm_h.item() == pytest.approx(norm_w.item(), rel=1e-12, abs=0)
        for (name, p), q in zip(whole.parts[0].named_parameters(), halves.parts[0].parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=3e-9, msg=lambda m, name=name: f"{name}: {m}")
