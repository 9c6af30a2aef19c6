"""The step (worker/step.TrainStep) in this process, without Ray: what it keeps alive."""

from __future__ import annotations

import weakref

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
