"""The baselines every place/plan report shows: the best single device and the even split, each with a step
time and speed-up, or "does not fit" with the memory needed and available."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cluster, graph
from devplace.graph import Placement
from devplace.placers.even import even_devices
from devplace.planning import baselines, place_graph
from devplace.sim import simulate


def chain(param: float):
    nodes = [{"id": v, "compute_s": 1.0, "param_bytes": param} for v in "abcd"]
    return graph(nodes, [("a", "b", 1), ("b", "c", 1), ("c", "d", 1)])


def test_a_single_device_that_cannot_hold_the_step_says_how_much_it_needs():
    g, c = chain(6.0), cluster(2, mem=15.0)
    single, even = baselines(g, c)
    on0 = simulate(g, c, Placement.from_array(g, np.zeros(4, dtype=np.int64)))
    assert not single.fits and single.speedup(1.0) is None
    assert single.needs_bytes == float(on0.peak_memory_bytes[0]) > 15.0 and single.has_bytes == 15.0
    split = simulate(g, c, Placement.from_array(g, even_devices(g, c)))
    assert even.fits and split.feasible and even.step_time_s == split.step_time_s
    assert even.speedup(2.0) == pytest.approx(split.step_time_s / 2.0)
    text = single.describe(c, 2.0)
    assert "does not fit" in text and "speed-up" not in text and "has 15 B on gpu0" in text


def test_both_baselines_fit_on_a_roomy_cluster_and_the_report_shows_their_speed_ups():
    g, c = chain(1.0), cluster(2, mem=1e9, speeds=[1.0, 2.0])
    placed = place_graph(g, c, placer="greedy", order="topo")
    single, even = placed.baselines
    assert single.fits and single.device == 1 and single.step_time_s == 2.0  # the faster device runs it all
    step = placed.result.step_time_s
    doc = placed.to_dict()
    assert doc["best_single_device"]["speedup"] == pytest.approx(2.0 / step) == doc["speedup_over_single_device"]
    assert doc["even_split"]["fits"] and doc["even_split"]["step_time_s"] == even.step_time_s
    text = placed.text()
    assert f"best single device (gpu1) 2.000 s, speed-up {2.0 / step:.2f}x" in text and "even split" in text


def test_an_even_split_over_memory_names_its_fullest_device():
    g, c = chain(6.0), cluster(2, mem=10.0)
    single, even = baselines(g, c)
    assert not single.fits and not even.fits
    split = simulate(g, c, Placement.from_array(g, even_devices(g, c)))
    worst = int(np.argmax(split.peak_memory_bytes - split.memory_bytes))
    assert even.device == worst and even.needs_bytes == float(split.peak_memory_bytes[worst]) > 10.0
    assert even.to_dict(c, 1.0) == {"name": "even split", "fits": False, "step_time_s": split.step_time_s,
                                    "speedup": None,
                                    "device": worst, "device_name": f"gpu{worst}", "needs_bytes": even.needs_bytes,
                                    "has_bytes": 10.0}


def test_a_pipeline_is_compared_with_the_even_split_under_its_schedule():
    from devplace.sim import Schedule

    g = graph([{"id": v, "kind": "forward", "compute_s": 1.0, "output_bytes": 4.0} for v in "abcd"],
              [("a", "b", 4), ("b", "c", 4), ("c", "d", 4)])
    c = cluster(2, mem=1e9)
    placed = place_graph(g, c, placer="pipeline", order="topo", schedule="1f1b", microbatches=4)
    _, even = placed.baselines
    piped = simulate(g, c, even_devices(g, c), schedule=Schedule("1f1b", 4))
    assert even.name == "even split (1f1b M=4)" and even.step_time_s == piped.step_time_s
    assert piped.step_time_s != simulate(g, c, even_devices(g, c)).step_time_s  # not the unpipelined step
    assert placed.to_dict()["even_split"]["step_time_s"] == piped.step_time_s
    assert "even split (1f1b M=4)" in placed.text()
