"""Collective costs on a cluster's links (DESIGN.md section 9b), against figures computed by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devplace.errors import ClusterError
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.hardware.collectives import (
    collective_s,
    node_of,
    ring_all_reduce_s,
    ring_link,
    ring_reduce_scatter_s,
)
from devplace.hardware.presets import PRESETS

GB = 1e9
S = 1e9  # a 1 GB message


def test_ring_formulas() -> None:
    assert ring_all_reduce_s(S, 4, 10 * GB, 1e-5) == pytest.approx(2 * 3 / 4 * 0.1 + 2 * 3 * 1e-5)
    assert ring_reduce_scatter_s(S, 4, 10 * GB, 1e-5) == pytest.approx(3 / 4 * 0.1 + 3 * 1e-5)
    assert ring_all_reduce_s(S, 1, 10 * GB, 1e-5) == 0.0


def test_one_nvswitch_node() -> None:
    c = PRESETS["8xA100-40GB-NVLink"]()
    assert node_of(c).tolist() == [0] * 8
    # 240 GB/s effective, 5 us: 2 * 7/8 * 1e9 / 240e9 + 14 * 5e-6
    assert collective_s(c, range(8), "all-reduce", S) == pytest.approx(0.0073616667, rel=1e-7)
    assert collective_s(c, range(8), "reduce-scatter", S) == pytest.approx(0.0036808333, rel=1e-7)
    assert collective_s(c, [2, 5], "all-gather", S) == pytest.approx(0.5 * S / 240e9 + 5e-6)
    assert collective_s(c, [3], "all-reduce", S) == 0.0


def test_two_nodes_of_eight_run_hierarchically() -> None:
    c = PRESETS["2x8xA100-IB"]()
    assert node_of(c).tolist() == [0] * 8 + [1] * 8
    rs_in = 7 / 8 * S / 240e9 + 7 * 5e-6  # 0.0036808333: inside each node, NVSwitch
    ar_x = 2 * 1 / 2 * (S / 8) / 22e9 + 2 * 1 * 10e-6  # 0.0057018182: S/8 across 2 nodes, HDR IB
    assert collective_s(c, range(16), "all-reduce", S) == pytest.approx(rs_in + ar_x + rs_in)
    assert collective_s(c, range(16), "all-reduce", S) == pytest.approx(0.0130634848, rel=1e-7)
    rs_x = 1 / 2 * (S / 8) / 22e9 + 10e-6
    assert collective_s(c, range(16), "reduce-scatter", S) == pytest.approx(rs_in + rs_x)
    assert collective_s(c, range(16), "all-gather", S) == pytest.approx(rs_x + rs_in)
    # one device per node: a flat ring over InfiniBand
    assert collective_s(c, [0, 8], "all-reduce", S) == pytest.approx(2 * 1 / 2 * S / 22e9 + 2 * 10e-6)
    # 2 + 2 devices: hierarchical with g = 2
    two = 1 / 2 * S / 240e9 + 5e-6
    assert collective_s(c, [0, 1, 8, 9], "all-reduce", S) == pytest.approx(two + (S / 2) / 22e9 + 2e-5 + two)
    # 3 + 1 devices: not an even split, so one flat ring at the slowest link it uses
    assert collective_s(c, [0, 1, 2, 8], "all-reduce", S) == pytest.approx(2 * 3 / 4 * S / 22e9 + 6 * 10e-6)
    # a group inside one node never touches InfiniBand
    assert collective_s(c, range(8, 16), "all-reduce", S) == collective_s(PRESETS["8xA100-40GB-NVLink"](),
                                                                             range(8), "all-reduce", S)


def test_ring_runs_at_its_slowest_link() -> None:
    c = PRESETS["8xV100-32GB-NVLink"]()  # DGX-1: 0-3 two links (40 GB/s), 3-7 one (20 GB/s), 0-7 PCIe (10 GB/s)
    assert node_of(c).tolist() == [0] * 8  # the NVLink mesh joins all eight
    assert ring_link(c, [0, 3]) == (40 * GB, 5e-6)
    assert ring_link(c, [0, 3, 7]) == (10 * GB, 15e-6)  # 7 -> 0 has no NVLink
    assert collective_s(c, [0, 3, 7], "all-reduce", S) == pytest.approx(2 * 2 / 3 * S / 10e9 + 4 * 15e-6)


@pytest.mark.parametrize(("group", "kind", "nbytes", "match"), [
    ([0, 0], "all-reduce", S, "distinct devices"),
    ([0, 9], "all-reduce", S, "distinct devices"),
    ([0, 1], "broadcast", S, "unknown collective"),
    ([0, 1], "all-reduce", -1.0, ">= 0 bytes"),
])
def test_bad_collectives(group: list[int], kind: str, nbytes: float, match: str) -> None:
    with pytest.raises(ClusterError, match=match):
        collective_s(PRESETS["8xA100-40GB-NVLink"](), group, kind, nbytes)


@given(n=st.integers(2, 6), nbytes=st.floats(0, 1e10), bw=st.floats(1e8, 1e12), lat=st.floats(0, 1e-3))
@settings(max_examples=50, deadline=None)
def test_all_reduce_is_reduce_scatter_then_all_gather(n: int, nbytes: float, bw: float, lat: float) -> None:
    c = Cluster("c", tuple(Device(f"g{i}", 1e9) for i in range(n)), Link(bw, lat))
    parts = collective_s(c, range(n), "reduce-scatter", nbytes) + collective_s(c, range(n), "all-gather", nbytes)
    assert collective_s(c, range(n), "all-reduce", nbytes) == pytest.approx(parts)
