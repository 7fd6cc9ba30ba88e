"""The contract every registered placer keeps: a complete, memory-feasible, seed-deterministic placement,
or a NoFitError that names the memory needed and available."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cluster
from devplace.graph import CompGraph
from devplace.orders import ORDERS
from devplace.placers import NoFitError, PlacerError, get_placer, place, placer_names
from devplace.sim import simulate
from devplace.zoo import layered_graph

# ilp is exact and exponential: it gets a graph small enough for it
SMALL = {"ilp"}


def small_graph() -> CompGraph:
    return layered_graph(12, width=3, fan_in=2, seed=3)


def medium_graph() -> CompGraph:
    return layered_graph(120, width=8, fan_in=2, seed=5)


def test_registry_lists_placers_with_their_settings():
    names = placer_names()
    assert names == sorted(names)
    for name in names:
        spec = get_placer(name)
        assert spec.summary, f"{name} needs a docstring"
    with pytest.raises(PlacerError, match="unknown placer 'nope'; choose one of"):
        get_placer("nope")


@pytest.mark.parametrize("name", placer_names())
def test_placement_is_complete_feasible_and_deterministic(name):
    g = small_graph() if name in SMALL else medium_graph()
    c = cluster(3, bw=12e9, lat=1e-5, mem=1e12)
    p1 = place(g, c, placer=name, order="topo", seed=7)
    p2 = place(g, c, placer=name, order="topo", seed=7)
    assert set(p1.assignment) == set(g.ids)
    assert p1.assignment == p2.assignment
    # a placer that returns a schedule (pipeline) is feasible, and timed, under that schedule
    r = simulate(g, c, p1, schedule=p1.schedule)
    assert r.feasible and r.step_time_s == p1.meta["step_time_s"]
    assert p1.made_by.placer == name


@pytest.mark.parametrize("name", placer_names())
def test_too_small_cluster_raises_a_clear_error(name):
    g = small_graph()
    need = float(g.param_bytes.sum())
    c = cluster(2, bw=12e9, mem=need / 4)
    with pytest.raises(NoFitError, match=r"needs about .* the cluster has"):
        place(g, c, placer=name)


def test_unknown_setting_lists_the_accepted_ones():
    name = placer_names()[0]
    with pytest.raises(PlacerError, match="has no setting 'colour'"):
        place(small_graph(), cluster(2), placer=name, colour="blue")


def test_unknown_order_lists_orders():
    with pytest.raises(Exception, match="topo"):
        place(small_graph(), cluster(2), placer=placer_names()[0], order="sideways")
    assert "topo" in ORDERS


def test_order_of_a_sequential_placer_is_recorded():
    for name in placer_names():
        if get_placer(name).uses_order:
            p = place(medium_graph(), cluster(2, bw=12e9, mem=1e12), placer=name, order="bfs")
            assert p.made_by.order == "bfs"
            assert np.isfinite(p.meta["step_time_s"])


def test_long_placers_report_progress():
    calls: list[tuple[int, int]] = []
    place(medium_graph(), cluster(2, bw=12e9, mem=1e12), placer="greedy", progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[0] == (0, 120) and calls[-1] == (119, 120)
    assert "progress" not in get_placer("greedy").settings and get_placer("greedy").reports_progress
