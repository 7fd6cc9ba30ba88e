"""Micro-batches that exist (issue 21, item 0): a micro-batch count must split the captured batch into equal
micro-batches, and a captured model's pipeline is placed on its micro-batch captured at batch / M, so every op is
costed at the micro-batch's size rather than the whole batch's divided by M."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from devplace.app.with_torch import place_prepared, prepare_model
from devplace.capture.custom import microbatch_prepared
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.errors import DevplaceError
from devplace.graph.batch import graph_batch, graph_microbatches
from devplace.hardware.cluster import load_cluster as get_preset
from devplace.placers import place
from devplace.placers.pipeline import pipeline_schedules
from devplace.sim import Schedule, ScheduleError, simulate

NETS = '''
import torch
from torch import nn


def build(batch=8):
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    return model, torch.randn(batch, 8, 8, 8)
'''


@pytest.fixture
def convnet(python_package):
    return python_package("mb_pkg", NETS) + ":build"


def _mlp_graph(batch: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return prepare(capture(model, (torch.randn(batch, 32),), loss_fn=lambda out: out.square().mean())).full


def test_a_schedule_whose_count_does_not_divide_the_batch_is_refused_with_the_counts_that_do():
    g = _mlp_graph(6)
    assert graph_batch(g) == 6
    devices = np.zeros(g.num_nodes, dtype=np.int64)
    with pytest.raises(ScheduleError, match=r"M=4 micro-batches do not split the batch of 6 .* M can be 1, 2, 3, 6"):
        simulate(g, get_preset("2xK80"), devices, schedule=Schedule("1f1b", 4))
    assert simulate(g, get_preset("2xK80"), devices, schedule=Schedule("1f1b", 3)).feasible


def test_the_pipeline_placer_only_tries_counts_that_divide_the_batch():
    # 1f1b on 2 devices runs M >= 2 (issue 30); gpipe any M
    assert [s.microbatches for s in pipeline_schedules("1f1b", None, None, 2, batch=12)] == [2, 4]
    assert [s.microbatches for s in pipeline_schedules("gpipe", None, None, 2, batch=12)] == [1, 2, 4]
    assert [s.microbatches for s in pipeline_schedules("1f1b", None, None, 2)] == [2, 4, 8, 16, 32]
    with pytest.raises(DevplaceError, match=r"microbatches=8 does not split the batch of 12 .* 1, 2, 3, 4, 6, 12"):
        pipeline_schedules("1f1b", 8, None, 2, batch=12)
    g = _mlp_graph(6)
    p = place(g, get_preset("2xK80"), placer="pipeline", order="topo")
    assert 6 % p.schedule.microbatches == 0


def test_a_micro_batch_graph_runs_only_under_its_own_count():
    g = _mlp_graph(4)
    g.meta["microbatches"] = 2  # what microbatch_prepared writes: one of 2 micro-batches of a batch of 8
    devices = np.zeros(g.num_nodes, dtype=np.int64)
    with pytest.raises(ScheduleError, match="one of 2 micro-batches"):
        simulate(g, get_preset("2xK80"), devices, schedule=Schedule("1f1b", 4, microbatch_graph=True))
    with pytest.raises(ScheduleError, match="one of 2 micro-batches"):
        simulate(g, get_preset("2xK80"), devices, schedule=Schedule("1f1b", 2))
    assert simulate(g, get_preset("2xK80"), devices, schedule=Schedule("1f1b", 2, microbatch_graph=True)).feasible


def test_a_micro_batch_is_captured_and_costed_at_its_own_size(convnet):
    whole = prepare_model(convnet, batch=8)
    micro = microbatch_prepared(whole, 4)
    assert graph_microbatches(micro.full) == 4 and graph_batch(micro.full) == 2
    assert graph_microbatches(micro.graph) == 4  # the coarse graph the placers get says so too
    # a small conv's time does not shrink with its batch: a quarter of the batch costs more than a quarter
    assert micro.full.compute_s.sum() > whole.full.compute_s.sum() / 4 * 1.05
    assert micro.full.param_bytes.sum() == whole.full.param_bytes.sum()
    with pytest.raises(DevplaceError, match=r"3 micro-batches do not split the batch of 8 .* 1, 2, 4, 8"):
        microbatch_prepared(whole, 3)
    assert microbatch_prepared(whole, 1) is whole


def test_a_captured_model_is_pipelined_on_micro_batches_of_its_own_size(convnet):
    whole = prepare_model(convnet, batch=8)
    cluster = get_preset("2xK80")
    placed = place_prepared(whole, cluster, placer="pipeline", order="topo")
    sched = placed.placement.schedule
    search = placed.placement.meta["microbatch_search"]
    assert search["batch"] == 8 and set(search["tried"]) == {"2", "4", "8"}  # 1f1b on 2 devices: M >= 2
    assert sched.microbatches == search["kept"] and sched.microbatch_graph == (sched.microbatches > 1)
    assert placed.result.step_time_s == min(t for t in search["tried"].values() if isinstance(t, float))
    if sched.microbatches > 1:
        assert graph_batch(placed.graph) == 8 // sched.microbatches
    text = " ".join(placed.text().split())
    assert f"batch 8 split into M={sched.microbatches}" in text
    # a count given by the user is the only one placed
    fixed = place_prepared(whole, cluster, placer="pipeline", order="topo", settings={"microbatches": 2})
    assert fixed.placement.schedule == Schedule("1f1b", 2, microbatch_graph=True)
    assert fixed.result.step_time_s == search["tried"]["2"]


@pytest.mark.parametrize("cluster_name", ["2xK80", "mixed"])
def test_no_pipeline_of_a_micro_batch_count_beats_its_bound(convnet, cluster_name):
    """`microbatch_bounds` (what the micro-batch search skips a count by, before capturing it) is below every
    pipeline of that count on micro-batches captured at their own size: the pipeline placer's, even's split run
    under 1F1B, and interleaved ones (the bound without the bubble)."""
    from dataclasses import replace

    from devplace.sim.bounds import microbatch_bounds, microbatch_outlook

    whole = prepare_model(convnet, batch=8)
    cluster = get_preset("2xK80")
    if cluster_name == "mixed":  # the second device 0.4x as fast
        cluster = replace(cluster, devices=(cluster.devices[0], replace(cluster.devices[1], speed=0.4)))
    one_stage = microbatch_bounds(whole.full, cluster, (1, 2, 4, 8), one_stage_per_device=True)
    any_schedule = microbatch_bounds(whole.full, cluster, (1, 2, 4, 8), one_stage_per_device=False)
    for m in (1, 2, 4, 8):
        micro = microbatch_prepared(whole, m)
        bound = one_stage[m]
        assert bound >= any_schedule[m] > 0
        kind = "1f1b" if m > 1 else "gpipe"  # torch's 1f1b runs M >= the 2 stages
        sched = Schedule(kind, m, microbatch_graph=m > 1)
        placed = place_prepared(whole, cluster, placer="pipeline", order="topo",
                                settings={"microbatches": m, "schedule": kind})
        assert placed.result.step_time_s >= bound
        # the bound on the count's own graph (what the search skips a count by once captured) holds too
        own = microbatch_outlook(micro.full, cluster, m, chunks=1, one_stage_per_device=True).bound_s
        assert placed.result.step_time_s >= own
        if cluster_name == "2xK80":  # even's split, in device index order (on mixed it puts the fast device last)
            devices = place(micro.full, cluster, placer="even", order="topo").to_array(micro.full, cluster.num_devices)
            assert simulate(micro.full, cluster, devices, schedule=sched).step_time_s >= bound
        if m % 2 == 0:
            inter = place_prepared(whole, cluster, placer="pipeline", order="topo",
                                   settings={"microbatches": m, "schedule": "interleaved-1f1b"})
            assert inter.result.step_time_s >= any_schedule[m]
            assert inter.result.step_time_s >= microbatch_outlook(micro.full, cluster, m, chunks=2,
                                                                  one_stage_per_device=False).bound_s


WIDE = '''
import torch
from torch import nn


def build(batch=256):
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(2048, 2048), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(2048, 10)), torch.randn(batch, 2048)
'''


def test_the_micro_batch_search_places_the_most_promising_count_first_and_skips_those_its_bounds_rule_out(
        python_package, monkeypatch):
    """Wide layers on 4 V100s at batch 256 under gpipe (every count that divides the batch): each count's own graph
    is captured (the whole step, M=1, is not captured again), the counts are placed in the order of the step their
    graph promises (`microbatch_outlook`), and a count whose bound is not below the fastest pipeline found by then
    is skipped without being placed, and logged so."""
    import devplace.capture.custom as custom
    from devplace.sim.bounds import microbatch_bounds, microbatch_outlook

    whole = prepare_model(python_package("mb_wide", WIDE) + ":build", batch=256)
    captured: dict[int, object] = {}
    real = custom.microbatch_prepared

    def capture_once(p, m):
        captured[m] = real(p, m)
        return captured[m]

    monkeypatch.setattr(custom, "microbatch_prepared", capture_once)
    cluster = get_preset("4xV100-16GB")
    placed = place_prepared(whole, cluster, placer="pipeline", order="topo", settings={"schedule": "gpipe"})
    search = placed.placement.meta["microbatch_search"]
    tried = search["tried"]
    assert sorted(captured) == [2, 4, 8, 16, 32]  # M=1 is the step itself
    outlook = {m: microbatch_outlook(captured[m].full if m > 1 else whole.full, cluster, m, chunks=1,  # type: ignore[attr-defined]
                                     one_stage_per_device=True) for m in (1, *captured)}
    order = sorted(outlook, key=lambda m: (outlook[m].estimate_s, -m))
    assert [int(m) for m in tried] == order  # logged in the order placed (or skipped)
    skipped = [int(m) for m, t in tried.items() if isinstance(t, str) and t.startswith("skipped")]
    assert skipped and search["kept"] not in skipped
    before = microbatch_bounds(whole.full, cluster, skipped, one_stage_per_device=True)
    for m in skipped:  # ruled out by a bound (before its graph was made, or on it), so never placed
        assert max(before[m], outlook[m].bound_s) >= placed.result.step_time_s
        assert tried[str(m)].startswith(f"skipped: no pipeline at M={m} beats")
    text = " ".join(placed.text().split())
    assert all(f"M={m} skipped" in text for m in skipped)  # the report says skipped, not "no fit"


def test_a_model_whose_result_micro_batching_changes_is_reported_and_kept_unpipelined():
    """Issue 30 item 6: BatchNorm normalises each micro-batch alone, so placer auto keeps such a model's own
    step (before: it tried and could pick a pipeline without a word) unless a schedule is asked for, and a
    pipelined plan of it says that its result changes. Eval-mode BatchNorm and LayerNorm change nothing."""
    from devplace.graph.batch import batch_statistics_ops
    from devplace.zoo import tiny

    whole = prepare_model("devplace.zoo.tiny:cnn_bn", batch=8)
    assert len(batch_statistics_ops(whole.full)) == 4  # one per BatchNorm2d
    cluster = get_preset("2xK80")
    auto = place_prepared(whole, cluster, order="topo")
    tried = auto.placement.meta["placer_auto"]["tried"]
    piped = [k for k in tried if k.startswith("pipeline")]
    assert piped and all(str(tried[k]).startswith("skipped: micro-batching changes this model's result") for k in piped)
    asked = place_prepared(whole, cluster, order="topo", settings={"schedule": "1f1b"})
    assert isinstance(asked.placement.meta["placer_auto"]["tried"]["pipeline 1f1b"], float)
    pipelined = place_prepared(whole, cluster, placer="pipeline", order="topo", settings={"microbatches": 2})
    assert "note: micro-batching changes this model's result" in " ".join(pipelined.text().split())
    assert "BatchNorm" in pipelined.to_dict()["microbatching_changes_result"]
    model, inputs = tiny.cnn_bn()
    for quiet in (capture(model.eval(), inputs), capture(*tiny.vit())):  # eval-mode BatchNorm; LayerNorm
        assert batch_statistics_ops(quiet) == []
