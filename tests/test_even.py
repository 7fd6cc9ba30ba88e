"""The `even` baseline placer: equal-compute contiguous parts of the module sequence, memory-checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import cluster, graph
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.graph.modules import forward_ops, module_of, module_starts
from devplace.graph.ties import tie_classes
from devplace.placers import NoFitError, PlacerError, place
from devplace.placers.even import even_cuts
from devplace.runtime import plan
from devplace.zoo import layered_graph


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=30), st.integers(1, 5), st.data())
def test_cuts_are_allowed_ordered_and_nearest_to_equal_shares(work, parts, data):
    allowed = [True, *data.draw(st.lists(st.booleans(), min_size=len(work) - 1, max_size=len(work) - 1))]
    cuts = even_cuts(np.asarray(work), allowed, parts)
    assert cuts == sorted(cuts)
    assert all(allowed[c] and c > 0 for c in cuts)
    positions = [i for i, ok in enumerate(allowed) if ok and i > 0]
    assert len(cuts) == (parts - 1 if positions else 0)
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    lo = 0
    for j, c in enumerate(cuts, start=1):
        target = prefix[-1] * j / parts
        # no allowed position at or after the previous cut is strictly nearer the target
        assert all(abs(prefix[c] - target) <= abs(prefix[p] - target) + 1e-9 for p in positions if p >= lo)
        lo = c


def test_chain_without_modules_is_cut_into_equal_compute_parts():
    g = graph([(f"n{i}", 1.0) for i in range(9)], [(f"n{i}", f"n{i + 1}", 8) for i in range(8)])
    p = place(g, cluster(3), placer="even", order="topo")
    assert [p.assignment[f"n{i}"] for i in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert p.made_by.placer == "even" and p.made_by.order is None


def test_even_split_over_memory_raises_no_fit():
    nodes = [{"id": f"n{i}", "compute_s": 1.0, "param_bytes": 100.0 if i < 2 else 1.0} for i in range(4)]
    g = graph(nodes, [(f"n{i}", f"n{i + 1}", 1) for i in range(3)])
    # the parameters (203 B) fit the cluster (2 x 150 B), and {n0}, {n1..n3} would fit, but the even
    # split {n0, n1}, {n2, n3} puts 200 B on device 0
    with pytest.raises(NoFitError, match="even split is over memory"):
        place(g, cluster(2, mem=150.0), placer="even", order="topo")


def test_captured_model_parts_are_whole_module_calls_with_backward_tied():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)], nn.Linear(16, 2))
    p = plan(model, torch.randn(4, 16), "3xGPU-placeto", placer="even", order="topo")
    g, devs = p.graph, np.asarray([p.placement.assignment[i] for i in p.graph.ids])
    fwd = forward_ops(g)
    fdev = devs[fwd].tolist()
    assert fdev == sorted(fdev) and set(fdev) == {0, 1, 2}  # contiguous, in device order
    starts = module_starts([module_of(g, v) or "" for v in fwd])
    changes = [i for i in range(1, len(fwd)) if fdev[i] != fdev[i - 1]]
    assert changes and all(i in starts for i in changes)  # each part begins where a module call begins
    # as autograd runs it: every tie class on one device, so placed = as run
    classes = tie_classes(g)
    assert all(len(set(devs[classes == c].tolist())) == 1 for c in np.unique(classes))
    assert p.runtime_result.step_time_s == pytest.approx(p.result.step_time_s)
    # the parts' compute (with their backward and optimizer ops) is roughly even: within one block's share
    share = np.bincount(devs, weights=g.compute_s, minlength=3)
    assert share.max() - share.min() <= g.compute_s.sum() / 3


# --------------------------------------------------------------------------- even-refine


def _step(g, c, placer, **settings):
    return place(g, c, placer=placer, order="topo", **settings).meta["step_time_s"]


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 4), st.floats(1.0, 1e3))
def test_even_refine_is_never_slower_than_even(seed, n_dev, bw):
    g = layered_graph(30, width=4, fan_in=2, seed=seed)
    c = cluster(n_dev, bw=bw, lat=1e-3)
    assert _step(g, c, "even-refine") <= _step(g, c, "even")


def test_even_refine_puts_parallel_branches_on_their_own_devices():
    # two independent chains of 4 ops behind a slow link (1 s per transfer): the even split of the
    # topological order (the chains interleaved) sends along both; the best placement runs each chain whole on
    # a device of its own (4 s, nothing to send)
    nodes = [(f"{b}{i}", 1.0) for b in "ab" for i in range(4)]
    edges = [(f"{b}{i}", f"{b}{i + 1}", 10.0) for b in "ab" for i in range(3)]
    g, c = graph(nodes, edges), cluster(4, bw=10.0)
    assert _step(g, c, "even") > 5.0
    p = place(g, c, placer="even-refine", order="topo")
    assert p.meta["step_time_s"] == pytest.approx(4.0)
    for b in "ab":
        assert len({p.assignment[f"{b}{i}"] for i in range(4)}) == 1
    assert p.assignment["a0"] != p.assignment["b0"]


def test_even_refine_repairs_an_even_split_that_is_over_memory():
    nodes = [{"id": f"n{i}", "compute_s": 1.0, "param_bytes": 100.0 if i < 2 else 1.0} for i in range(4)]
    g = graph(nodes, [(f"n{i}", f"n{i + 1}", 1) for i in range(3)])
    c = cluster(2, mem=150.0)
    with pytest.raises(NoFitError):
        place(g, c, placer="even", order="topo")
    p = place(g, c, placer="even-refine", order="topo")
    assert p.assignment["n0"] != p.assignment["n1"]  # the two 100 B ops apart: the only way to fit


def test_even_refine_spends_at_most_max_evals_and_checks_it():
    g = layered_graph(40, width=4, fan_in=2, seed=1)
    c = cluster(3, bw=5.0, lat=1e-3)
    # one simulation: the even split itself
    assert place(g, c, placer="even-refine", order="topo", max_evals=1).assignment == \
        place(g, c, placer="even", order="topo").assignment
    for bad in (0, -1, 2.5, True):
        with pytest.raises(PlacerError, match="max_evals"):
            place(g, c, placer="even-refine", order="topo", max_evals=bad)


def test_even_on_a_coarse_captured_graph_cuts_at_module_starts():
    # under the autograd rule `place` hands `even` the coarse graph itself (it takes `ties`), not the folded
    # graph, which has no module paths: the parts are still runs of whole module calls
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)], nn.Linear(16, 2))
    prep = prepare(capture(model, (torch.randn(4, 16),), optimizer="adam"), max_nodes=30)
    g = prep.graph
    p = place(g, cluster(3), placer="even")
    assert p.meta["ties"] == "native"
    devs = np.asarray([p.assignment[i] for i in g.ids])
    fwd = forward_ops(g)
    starts = module_starts([module_of(g, v) or "" for v in fwd])
    changes = [i for i in range(1, len(fwd)) if devs[fwd[i]] != devs[fwd[i - 1]]]
    assert changes and all(i in starts for i in changes)


def test_even_refine_on_a_coarse_training_graph_keeps_ties_and_is_never_slower_than_even():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    prep = prepare(capture(model, (torch.randn(16, 32),), optimizer="adam"), max_nodes=20)
    g = prep.graph
    c = cluster(3, bw=1e9, lat=1e-6)
    even_p, refined = (place(g, c, placer=name) for name in ("even", "even-refine"))
    assert refined.meta["ties"] == "native"
    assert refined.meta["step_time_s"] <= even_p.meta["step_time_s"]
    classes = tie_classes(g)
    devs = np.asarray([refined.assignment[i] for i in g.ids])
    assert all(len(set(devs[classes == k].tolist())) == 1 for k in np.unique(classes))
