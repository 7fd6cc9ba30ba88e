"""Per-device-kind costs (issue 21, item 0): on a cluster of several GPU kinds every op is costed for each kind
from that kind's peak for the op's precision, the simulator and the placers use each device's own times, and
the order in which a cluster lists its devices changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from devplace.app.with_torch import place_prepared
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.errors import GraphError
from devplace.graph.coarsen import colocate
from devplace.graph.compgraph import CompGraph
from devplace.graph.ties import fold
from devplace.hardware.cluster import Cluster, Link, op_times
from devplace.hardware.cost import cost_devices
from devplace.hardware.presets import A100_SXM4_40GB, V100_PCIE_16GB, gpus
from devplace.sim import simulate


def _mixed(fast_first: bool) -> Cluster:
    fast, slow = gpus(A100_SXM4_40GB, 2, prefix="a"), gpus(V100_PCIE_16GB, 2, prefix="v")
    return Cluster("mixed", fast + slow if fast_first else slow + fast, Link(12e9, 1e-5))


def _captured(width: int = 256, batch: int = 64) -> CompGraph:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 8))
    return capture(model, (torch.randn(batch, width),), loss_fn=lambda out: out.square().mean())


def test_kind_times_are_read_written_and_checked():
    g = CompGraph.build("g", [{"id": "a", "compute_s": 1.0, "compute_s_by_kind": {"A": 0.5, "B": 2.0}},
                              {"id": "b", "compute_s_by_kind": {"A": 0.25, "B": 1.0}}],
                        [{"src": "a", "dst": "b", "bytes": 8}])
    assert g.node_record(1)["compute_s_by_kind"] == {"A": 0.25, "B": 1.0}
    assert CompGraph.build("h", [g.node_record(v) for v in range(2)], [g.edge_record(0)]).kind_compute["B"][0] == 2.0
    with pytest.raises(GraphError, match="give every node the same device kinds"):
        CompGraph.build("g", [{"id": "a", "compute_s_by_kind": {"A": 1}}, {"id": "b", "compute_s_by_kind": {"B": 1}}],
                        [])
    with pytest.raises(GraphError, match="has \"compute_s_by_kind\" but node 'a' has none"):
        CompGraph.build("g", [{"id": "a"}, {"id": "b", "compute_s_by_kind": {"B": 1}}], [])
    with pytest.raises(GraphError, match="must be an object of device kind -> seconds"):
        CompGraph.build("g", [{"id": "a", "compute_s_by_kind": [1]}], [])
    # a device of a listed kind takes that kind's time; any other compute_s / speed
    from devplace.hardware.cluster import Device

    c = Cluster("c", (Device("x", 1e9, speed=2.0, kind="B"), Device("y", 1e9, speed=2.0)), Link(1e9))
    assert op_times(g, c).tolist() == [[2.0, 0.5], [1.0, 0.0]]
    assert simulate(g, c, np.array([0, 0])).step_time_s == 3.0


def test_every_op_is_costed_for_each_kind_from_that_kinds_peak_for_its_precision():
    g = _captured(2048, 1024)  # matrix products large enough to be bound by the FLOP rate
    ref, kinds = cost_devices(_mixed(False))
    assert [k.kind for k in kinds] == ["A100-SXM4-40GB", "V100-PCIe-16GB"] and ref is kinds[0]
    costed = prepare(g, device=ref, kinds=kinds).full
    a100, v100 = costed.kind_compute["A100-SXM4-40GB"], costed.kind_compute["V100-PCIe-16GB"]
    mm = [v for v in range(costed.num_nodes) if costed.op[v].split(".")[1:2] in (["addmm"], ["mm"])]
    assert mm
    # fp32 matrix products run on the CUDA cores: 19.5 vs 14 TFLOPS, not the tensor cores' 312 vs 112
    ratio = v100[mm].sum() / a100[mm].sum()
    assert 1.2 < ratio < 19.5 / 14 * 1.01
    # the graph's compute_s is in the reference kind's speed-1.0 units, whatever order the cluster lists
    np.testing.assert_allclose(costed.compute_s, a100 * ref.speed)
    # colocation and folding carry the kinds' times
    col = colocate(costed).graph
    assert col.kind_compute["V100-PCIe-16GB"].sum() == pytest.approx(v100.sum())
    assert fold(costed).graph.kind_compute["A100-SXM4-40GB"].sum() == pytest.approx(a100.sum())


def test_the_same_gpus_in_another_order_cost_and_simulate_alike():
    g = _captured()
    fast, slow = _mixed(True), _mixed(False)
    graphs = [prepare(g, device=cost_devices(c)[0], kinds=cost_devices(c)[1]).full for c in (fast, slow)]
    assert np.array_equal(graphs[0].compute_s, graphs[1].compute_s)
    by_name = [dict(zip([d.name for d in c.devices], op_times(gr, c).T, strict=True))
               for c, gr in zip((fast, slow), graphs, strict=True)]
    assert all(np.array_equal(by_name[0][n], by_name[1][n]) for n in by_name[0])
    # one placement, by device name, has one step whichever order the cluster lists its devices in
    rng = np.random.default_rng(0)
    names = [fast.devices[int(d)].name for d in rng.integers(0, 4, g.num_nodes)]
    steps = [simulate(gr, c, np.array([[d.name for d in c.devices].index(n) for n in names])).step_time_s
             for c, gr in zip((fast, slow), graphs, strict=True)]
    assert steps[0] == steps[1]


@pytest.mark.parametrize("placer", ["m-etf", "pipeline", "contiguous"])
def test_placers_on_a_mixed_cluster_fit_and_stay_above_the_bound(placer):
    for fast_first in (True, False):
        c = _mixed(fast_first)
        ref, kinds = cost_devices(c)
        placed = place_prepared(prepare(_captured(), device=ref, kinds=kinds), c, placer=placer, order="topo")
        assert placed.result.feasible
        assert placed.bound.value_s <= placed.result.step_time_s * (1 + 1e-12)


def test_the_pipeline_on_the_same_gpus_in_another_order_gives_the_same_step():
    from devplace.placers import place
    from devplace.placers.pipeline import device_orders

    g = _captured(512, 256)
    steps = []
    for fast_first in (True, False):
        c = _mixed(fast_first)
        ref, kinds = cost_devices(c)
        costed = prepare(g, device=ref, kinds=kinds).full
        orders = device_orders(costed, c)
        kind_of = [[c.devices[d].kind for d in o] for o in orders]
        assert kind_of == [["A100-SXM4-40GB"] * 2 + ["V100-PCIe-16GB"] * 2,
                           ["V100-PCIe-16GB"] * 2 + ["A100-SXM4-40GB"] * 2]  # fastest first, slowest first
        p = place(costed, c, placer="pipeline", order="topo", microbatches=4, semantics="autograd")
        assert (p.schedule.device_order or (0, 1, 2, 3)) in orders  # None: by index
        steps.append(p.meta["step_time_s"])
    assert steps[0] == pytest.approx(steps[1], rel=1e-9)
