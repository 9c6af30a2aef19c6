"""A tensor-parallel group never spans nodes on GPUs: refused in one line, before launch where the
cluster's nodes are known and on each GPU worker from its node's worker count."""

from __future__ import annotations

import pytest

from raytrain_lm.config.layout import Layout
from raytrain_lm.errors import UserError


def tp_layout(tp: int) -> Layout:
    return Layout(dp=1, tp=tp, pp=1, strategy="ddp", ac="none", sp=False, schedule="-",
                  micro_batch=1, microbatches=1, seq_len=8)


@pytest.mark.parametrize("tp, on_node", [(2, 8), (4, 8), (8, 8), (1, 1), (2, 2)])
def test_tp_groups_inside_a_node_pass(tp, on_node):
    tp_layout(tp).check_tp_within_node(on_node)


@pytest.mark.parametrize("tp, on_node", [(2, 1), (8, 4), (2, 3), (4, 6)])
def test_a_tp_group_that_would_span_nodes_is_refused_on_the_worker(tp, on_node):
    with pytest.raises(UserError, match=rf"--tp {tp} needs .* a node runs {on_node} .*smaller --tp"):
        tp_layout(tp).check_tp_within_node(on_node)


def test_the_driver_refuses_tp_beyond_the_largest_node():
    tp_layout(8).check_tp_fits_nodes([0.0, 8.0, 1.0])
    tp_layout(2).check_tp_fits_nodes([0.0])  # no GPU node yet (an autoscaler may add them): the workers check
    with pytest.raises(UserError, match=r"--tp 2 needs 2 GPUs on one node .* at most 1;"):
        tp_layout(2).check_tp_fits_nodes([0.0, 1.0, 1.0])  # the 1-GPU A10G nodes
