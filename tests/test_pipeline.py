"""Model -> captured, costed, coarsened graph (devplace.capture.pipeline), and back: a placement of the
groups expands to every op."""

from __future__ import annotations

import numpy as np
import pytest

from devplace.capture.pipeline import family_graph, prepare, zoo_prepared
from devplace.errors import DevplaceError
from devplace.hardware.cluster import load_cluster
from devplace.hardware.presets import device_kind
from devplace.placers import place
from devplace.sim import simulate


def test_zoo_model_to_placement_of_every_op():
    prepared = zoo_prepared("resnet50", batch=2, max_nodes=60)
    full, coarse = prepared.full, prepared.graph
    assert coarse.num_nodes <= 60 < full.num_nodes
    # costing and coarsening keep the work and the persistent memory
    assert coarse.compute_s.sum() == pytest.approx(full.compute_s.sum(), rel=1e-12)
    assert coarse.param_bytes.sum() == full.param_bytes.sum()
    assert full.compute_s.sum() > 0
    c = load_cluster("4xV100-16GB")
    p = place(coarse, c, placer="m-etf")
    expanded = prepared.coarsening.expand(p)
    assert set(expanded.assignment) == set(full.ids)
    assert simulate(full, c, expanded).feasible


def test_costs_follow_the_device_speed():
    from devplace.capture.pipeline import capture_zoo_model

    graph = capture_zoo_model("resnet50", batch=2)
    v100 = prepare(graph, device=device_kind("V100")).full
    a100 = prepare(graph, device=device_kind("A100")).full
    # compute_s is in speed-1.0 (V100) units; an A100 estimate differs only through its own roofline
    assert v100.compute_s.sum() > 0 and a100.compute_s.sum() > 0
    assert v100.num_nodes == a100.num_nodes


def test_family_graphs_are_seeded_and_coarsened():
    a = family_graph("cifar10", 3, max_nodes=120)
    b = family_graph("cifar10", 3, max_nodes=120)
    assert a.num_nodes <= 120
    assert a.ids == b.ids and np.array_equal(a.compute_s, b.compute_s)
    assert a.meta["family"]["name"] == "cifar10" and a.meta["family"]["index"] == 3
    other = family_graph("cifar10", 4, max_nodes=120)
    assert other.meta["family"]["arch"] != a.meta["family"]["arch"]


def test_a_family_graph_is_placed_op_by_op_unless_told_otherwise():
    # issue 22: under the autograd rule the families collapsed (ptb graph 0: 300 groups, 3 units)
    from devplace.hardware import load_cluster
    from devplace.placers import place

    g, c = family_graph("cifar10", 3, max_nodes=120), load_cluster("3xGPU-placeto")
    assert g.meta["semantics"] == "op-by-op"
    placed = place(g, c, placer="m-topo", order="topo")
    assert placed.made_by.semantics == "op-by-op" and "tie_classes" not in placed.meta  # every group a unit
    assert place(g, c, placer="m-topo", order="topo", semantics="autograd").meta["tie_classes"] < g.num_nodes


def test_unknown_model_is_a_clear_error():
    with pytest.raises(DevplaceError, match="resnet50"):
        zoo_prepared("resnet-9000")


@pytest.mark.parametrize("name", ["inception_v3", "resnet50", "vgg16", "mobilenet_v3_large", "bert-base", "gpt2",
                                  "gpt2-xl", "t5-small", "llama-1b", "gnmt"])
def test_every_zoo_model_captures(name):
    from devplace.zoo.models import get_spec

    seq = 8 if get_spec(name).seq_len else None
    # batch 2: batch norm in training mode needs more than one value per channel
    prepared = zoo_prepared(name, batch=2, seq_len=seq, max_nodes=80)
    full = prepared.full
    assert {"forward", "backward", "optimizer"} <= set(full.kind)
    assert prepared.graph.num_nodes <= 80
    # Adam: weights + gradients + 2 states, float32, for every parameter
    assert full.meta["capture"]["param_bytes"] == full.meta["capture"]["params"] * 4 * 4
