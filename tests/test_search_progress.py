"""A search over candidates (placer auto, order auto) reports one progress for all of it, naming the candidate
that runs, and its time is the whole search's with each candidate's in the meta (`--json`)."""

from __future__ import annotations

from conftest import cluster
from devplace.defaults import AUTO_PLACERS
from devplace.placers import SearchProgress, place
from devplace.planning import place_graph
from devplace.zoo import layered_graph


def test_placer_auto_with_order_auto_reports_one_growing_fraction_and_names_each_candidate():
    g, c = layered_graph(24, width=3, seed=1), cluster(3)
    seen: list[tuple[float, str]] = []
    place(g, c, placer="auto", order="auto", autograd_rule=False,
          progress=SearchProgress(lambda fraction, label: seen.append((fraction, label))))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] >= 0.0 and fractions[-1] <= 1.0
    labels = {label for _, label in seen}
    for i, p in enumerate(AUTO_PLACERS):
        assert any(label.startswith(f"placer {p} ({i + 1}/{len(AUTO_PLACERS)})") for label in labels)
    # the placers that walk an order show which order runs, with the count of the orders tried
    assert any(label.startswith("placer m-etf (1/") and " · order " in label for label in labels)


def test_the_placement_time_is_the_whole_search_with_each_candidate_time_in_the_meta():
    g, c = layered_graph(24, width=3, seed=1), cluster(3)
    placed = place_graph(g, c, placer="auto", order="auto")
    doc = placed.to_dict()
    times = doc["placer_auto"]["time_s"]
    assert list(times) == list(AUTO_PLACERS)
    assert sum(times.values()) <= doc["placement_time_s"]
    assert "the whole search (placer auto) took" in placed.text()
    auto = placed.placement.meta["order_auto"]
    assert auto["time_s"].keys() == auto["tried"].keys()
