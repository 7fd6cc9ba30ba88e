"""The same GPUs listed in another order give the same answer (issue 21): placers see the cluster's devices in
a canonical order (`hardware.cluster.canonical_order`), and the answer is mapped back to the file's order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from devplace.hardware.cluster import Cluster, Device, Link, canonical_order, reordered
from devplace.placers import place
from devplace.zoo.synthetic import layered_graph

SPEEDS = (1.0, 0.5, 1.0, 0.5)


def cluster(order: tuple[int, ...]) -> Cluster:
    """Four devices (two fast, two slow, named after themselves) listed in `order`, with one slow link
    between the first two listed devices' originals 0 and 1."""
    devices = tuple(Device(f"d{i}", 4e9, SPEEDS[i]) for i in order)
    where = {d: k for k, d in enumerate(order)}
    return Cluster("c", devices, Link(1e9, 1e-5), {(where[0], where[1]): Link(1e8, 1e-4)})


def test_the_canonical_order_does_not_depend_on_the_listing():
    g = layered_graph(40, width=4, seed=0)
    seen = set()
    for order in itertools.permutations(range(4)):
        c = cluster(order)
        canon = reordered(c, canonical_order(g, c))
        seen.add((tuple(d.name for d in canon.devices), canon.bandwidth.tobytes()))
    assert len(seen) == 1


@pytest.mark.parametrize("placer", ["m-etf", "greedy", "even-refine", "auto"])
def test_a_placement_does_not_depend_on_the_order_devices_are_listed_in(placer):
    g = layered_graph(60, width=4, seed=1)
    steps, by_name = set(), set()
    for order in ((0, 1, 2, 3), (1, 3, 0, 2), (2, 0, 3, 1)):
        c = cluster(order)
        p = place(g, c, placer=placer, order="topo")
        steps.add(round(float(p.meta["step_time_s"]), 12))
        names = np.array([d.name for d in c.devices])[p.to_array(g, 4)]
        by_name.add(tuple(names.tolist()))
    assert len(steps) == 1
    assert len(by_name) == 1  # each op on the same named device
