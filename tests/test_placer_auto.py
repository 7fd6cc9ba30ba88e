"""Placer "auto" (the default): the best of `AUTO_PLACERS`, each at its defaults, judged as order "auto" is."""

from __future__ import annotations

import pytest

from conftest import cluster, graph
from conftest import run_cli as run
from devplace.defaults import AUTO_PLACER, AUTO_PLACERS, DEFAULT_PLACER
from devplace.placers import PlacerError, place, place_expanded
from test_order_auto import three_branches


def test_the_default_placer_keeps_the_fastest_of_its_placers() -> None:
    assert DEFAULT_PLACER == AUTO_PLACER
    full, _, c = three_branches()
    p = place(full, c, order="topo")
    auto = p.meta["placer_auto"]
    assert list(auto["tried"]) == list(AUTO_PLACERS)
    for name, step in auto["tried"].items():
        assert step == place(full, c, placer=name, order="topo").meta["step_time_s"]
    assert p.meta["step_time_s"] == min(auto["tried"].values()) and p.made_by.placer == auto["placer"]


def test_on_a_coarsened_model_each_placer_is_judged_on_the_full_graph() -> None:
    full, coarsening, c = three_branches()
    ex = place_expanded(coarsening, full, c, placer=AUTO_PLACER, order="topo")
    tried = ex.placement.meta["placer_auto"]["tried"]
    for name, step in tried.items():
        assert step == place_expanded(coarsening, full, c, placer=name, order="topo").result.step_time_s
    assert ex.result.step_time_s == min(tried.values()) and ex.coarse.meta["placer_auto"]["tried"] == tried


def test_settings_need_a_named_placer() -> None:
    g, c = graph([("a", 1.0), ("b", 1.0)], [("a", "b", 1.0)]), cluster(2)
    with pytest.raises(PlacerError, match="name the placer"):
        place(g, c, placer=AUTO_PLACER, steps=10)


def test_the_cli_reports_the_placer_it_kept(capsys, monkeypatch) -> None:
    import json

    code, out, err = run(["place", "example", "-c", "4xV100-16GB", "--json"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["placer"] == doc["placer_auto"]["placer"] in AUTO_PLACERS
    assert doc["step_time_s"] == min(doc["placer_auto"]["tried"].values())
    code, out, err = run(["place", "example", "-c", "4xV100-16GB"], capsys, monkeypatch)
    assert f"placer auto -> {doc['placer']}" in " ".join(out.split())


def test_where_one_placer_is_needed_auto_is_refused_with_the_names() -> None:
    from devplace.placers import get_placer

    with pytest.raises(PlacerError, match=r"is not one placer; here name one of: .*m-etf"):
        get_placer(AUTO_PLACER)


def two_big_layers():
    # parameters fit a 50-byte device, the activations held from forward to backward (120 B) do not
    return graph([{"id": "a", "compute_s": 1.0, "output_bytes": 60.0, "param_bytes": 5.0},
                  {"id": "b", "compute_s": 1.0, "output_bytes": 60.0, "param_bytes": 5.0}], [("a", "b", 60.0)])


def test_when_no_placement_without_micro_batches_fits_auto_pipelines_the_step() -> None:
    from devplace.sim import simulate

    g, c = two_big_layers(), cluster(2, mem=50.0)
    p = place(g, c, order="topo")
    auto = p.meta["placer_auto"]
    assert p.made_by.placer == auto["placer"] == "pipeline" and "micro-batches" in auto["why"]
    # the memory lower bound rules them out before they run (130 B when b starts: parameters, a's and b's output)
    assert all(auto["tried"][name].startswith("skipped: no placement without micro-batches fits, its lower bound")
               for name in AUTO_PLACERS)
    again = simulate(g, c, p, schedule=p.schedule)
    assert again.feasible and auto["tried"]["pipeline"] == again.step_time_s == p.meta["step_time_s"]


def test_when_nothing_fits_the_error_gives_each_placers_reason() -> None:
    from devplace.placers import NoFitError

    with pytest.raises(NoFitError) as info:
        place(two_big_layers(), cluster(2, mem=12.0), order="topo")  # one layer's parameters and output: 65 B
    text = str(info.value)
    assert text.startswith("placer 'auto' found no placement") and "\n" not in text
    assert all(f"{p}: " in text for p in (*AUTO_PLACERS, "pipeline"))


def test_placers_that_cannot_fit_by_the_memory_lower_bound_are_skipped_and_logged_so(monkeypatch) -> None:
    # 8 layers stash 10 bytes each for their backward: when the backward begins 80 bytes of activations and
    # 8 of parameters are held somewhere, the two devices have 60; the pipeline (micro-batches) fits
    from devplace.placers import registry, search_placement

    n = 8
    nodes = [{"id": f"l{i}", "kind": "forward", "compute_s": 1.0, "output_bytes": 10.0, "param_bytes": 1.0}
             for i in range(n)]
    nodes += [{"id": f"g{i}", "kind": "backward", "group": f"l{i}", "compute_s": 2.0} for i in reversed(range(n))]
    edges = [{"src": f"l{i}", "dst": f"l{i + 1}", "bytes": 10.0} for i in range(n - 1)]
    edges += [{"src": f"l{i}", "dst": f"g{i}", "bytes": 10.0} for i in range(n)]
    edges += [{"src": f"g{i + 1}", "dst": f"g{i}", "bytes": 1.0} for i in range(n - 1)]
    g = graph(nodes, edges)
    ran: list[str] = []
    real = registry.get_placer

    def watched(name: str):  # note every placer the search runs
        spec = real(name)
        return type(spec)(**{**spec.__dict__, "func": lambda *a, **k: (ran.append(spec.name), spec.func(*a, **k))[1]})

    monkeypatch.setattr("devplace.placers.search.get_placer", watched)
    found = search_placement(g, cluster(2, mem=30.0, bw=1e6), order="topo")
    skipped = {e.placer: e.dropped for e in found.log if e.level == "placer" and e.placer in AUTO_PLACERS}
    assert set(skipped) == set(AUTO_PLACERS)
    for why in skipped.values():
        assert why.startswith("skipped: no placement without micro-batches fits, its lower bound on memory is 88 B")
    assert not set(ran) & set(AUTO_PLACERS)
    assert found.placement.schedule is not None and found.result.feasible  # the pipeline, the last resort
