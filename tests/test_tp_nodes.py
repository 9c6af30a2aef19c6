"""A tensor-parallel group never spans nodes on GPUs: refused in one line, before launch where the
cluster's nodes are known and on each GPU worker from its node's worker count."""

from __future__ import annotations

import pytest

from raytrain_lm.config.checks import check_tp_fits_nodes, check_tp_in_node
from raytrain_lm.errors import UserError


@pytest.mark.parametrize("tp, on_node", [(2, 8), (4, 8), (8, 8), (1, 1), (2, 2)])
def test_tp_groups_inside_a_node_pass(tp, on_node):
    check_tp_in_node(tp, on_node)


@pytest.mark.parametrize("tp, on_node", [(2, 1), (8, 4), (2, 3), (4, 6)])
def test_a_tp_group_that_would_span_nodes_is_refused_on_the_worker(tp, on_node):
    with pytest.raises(UserError, match=rf"--tp {tp} needs .* a node runs {on_node} .*smaller --tp"):
        check_tp_in_node(tp, on_node)


def test_the_driver_refuses_tp_beyond_the_largest_node():
    check_tp_fits_nodes(8, [0.0, 8.0, 1.0])
    check_tp_fits_nodes(2, [0.0])  # no GPU node yet (an autoscaler may add them): the workers check
    with pytest.raises(UserError, match=r"--tp 2 needs 2 GPUs on one node .* at most 1;"):
        check_tp_fits_nodes(2, [0.0, 1.0, 1.0])  # the 1-GPU A10G nodes
