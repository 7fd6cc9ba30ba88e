"""The V schedules in the default search (issue 31): `--schedule zbv` (or the default, when a V is the fastest)
answers a parallel plan whose placement records each op's stage ("stages"), so that the saved plan replays the
step its search judged and runs as that V: two processes, four stages, the one-process loss and gradients."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import cluster
from devplace.errors import DevplaceError
from devplace.graph.parallel import STAGES_KEY, ParallelPlan, ParallelPlanError, recorded_stages, stages_record
from devplace.graph.schedule import stage_position
from devplace.planning import simulate_placement
from devplace.runtime import plan
from devplace.runtime.parallel_export import parallel_export, recorded_split
from devplace.runtime.parallel_run import run_parallel
from devplace.runtime.plan import load_plan
from devplace.sim.parallel import simulate_parallel
from test_parallel_run import _net


def test_a_v_plan_saved_replays_its_step_and_runs_as_that_v(tmp_path) -> None:
    model, inputs = _net()
    p = plan(model, inputs, "2xK80", schedule="zbv")
    par = p.placement.meta["parallel"]
    assert (par["schedule"], par["pp"], par["chunks"], par["dp"]) == ("zbv", 2, 2, 1)
    stages = p.placement.meta[STAGES_KEY]
    assert sorted(set(stages.values())) == [0, 1, 2, 3]  # 4 stages on 2 devices: the V's turn is on device 1
    # every op on the device its stage's position runs on: out along the devices and back
    assert all(p.placement.assignment[i] == stage_position("zbv", s, 2) for i, s in stages.items())
    path = tmp_path / "plan.json"
    p.save(path)
    again = load_plan(path)
    assert again.placement.meta[STAGES_KEY] == stages
    assert again.result.step_time_s == p.result.step_time_s  # the search's step, simulated again from the file
    # `devplace simulate` of the placement: replica 0's V pipeline, on the recorded stages
    stage = np.array(recorded_stages(ParallelPlan.from_dict(par), again.graph.ids, again.placement.assignment, stages))
    pipeline = simulate_parallel(again.graph, again.cluster, stage, ParallelPlan.from_dict(par)).pipelines[0]
    alone = simulate_placement(again.graph, again.cluster, again.placement).result
    assert alone.step_time_s == pipeline.step_time_s and np.array_equal(alone.stage, pipeline.stage)
    # its export cuts where its recorded stages begin, and runs as that V: the one-process loss and gradients
    plan_, points = recorded_split(again.graph, again.placement)
    assert plan_ == ParallelPlan.from_dict(par) and len(points) == 3
    ran = run_parallel(model, inputs, json.loads(json.dumps(parallel_export(plan_, points))), steps=1,
                       return_grads=True)
    assert ran.processes == 2
    ref = copy.deepcopy(model)
    loss = ref(*inputs)
    loss.backward()
    assert sorted(ran.grads) == sorted(n for n, _ in ref.named_parameters())
    for name, param in ref.named_parameters():
        torch.testing.assert_close(ran.grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ran.losses == pytest.approx([loss.item()], rel=1e-5)


def test_a_stage_record_is_checked_against_its_plan() -> None:
    plan_ = ParallelPlan(dp=1, pp=2, microbatches=4, batch=4, schedule="zbv")
    ids = ["a", "b", "c", "d"]
    record = stages_record(ids, np.array([0, 1, 2, 3]))
    on = {"a": 0, "b": 1, "c": 1, "d": 0}
    assert recorded_stages(plan_, ids, on, record) == [0, 1, 2, 3]
    with pytest.raises(ParallelPlanError, match="records no \"stages\""):
        recorded_stages(plan_, ids, on, None)
    with pytest.raises(ParallelPlanError, match="give each of the graph's 4 ops"):
        recorded_stages(plan_, ids, on, {"a": 0})
    with pytest.raises(ParallelPlanError, match=r"stage 4; the plan .* has stages 0\.\.3"):
        recorded_stages(plan_, ids, on, {**record, "d": 4})
    with pytest.raises(ParallelPlanError, match="its stage 2 runs on device 1"):
        recorded_stages(plan_, ids, {**on, "c": 0}, record)
    # a plan of one chunk per device saved before the record: its devices' positions
    one = ParallelPlan(dp=1, pp=2, microbatches=4, batch=4, schedule="1f1b", devices=(1, 0))
    assert recorded_stages(one, ids, {"a": 1, "b": 1, "c": 0, "d": 0}, None) == [0, 0, 1, 1]


def test_the_search_fixes_a_v_and_refuses_one_it_cannot_run(capsys, monkeypatch) -> None:
    from devplace.placers import search_placement
    from devplace.placers.registry import PlacerError
    from test_parallel_search import captured, provider

    found = search_placement(captured(), cluster(4, bw=1e10, mem=4e10), microbatch_graph=provider, schedule="zbv")
    assert found.parallel is not None and found.parallel.plan.schedule == "zbv"
    tried = found.placement.meta["parallel_search"]["tried"]
    # only the V, on every dp that leaves a pipeline (4 layers make no V of 8 stages: said so)
    assert all(label.endswith(" zbv") or " zbv M=" in label for label in tried)
    assert {label.split(" zbv")[0] for label in tried if " pp=" in label} == {"dp=2 pp=2"}
    # no plan: why, for dp=1 (pp=4); at M = 8 micro-batches of 1 sample (costing as much as 2 here) every degree's
    # bound is above the plan found at 4
    others = {label: v for label, v in tried.items() if " pp=" not in label}
    assert others.pop("dp=1 M=4 zbv").startswith("no pipeline of 8 stages in a V")
    assert set(others) == {"dp=1 M=8 zbv", "dp=2 M=4 zbv"}
    assert all(v.startswith("skipped: no plan beats 16.2 s") for v in others.values())
    from devplace.graph.parallel import ParallelAsk

    with pytest.raises(PlacerError, match="--schedule dualpipev runs a pipeline of 2 or more stages"):
        search_placement(captured(), cluster(4, bw=1e10, mem=4e10), microbatch_graph=provider,
                         parallel=ParallelAsk(dp=4), schedule="dualpipev")
    with pytest.raises(DevplaceError, match="drop --placer"):
        from devplace.app import check_pipeline_settings

        check_pipeline_settings("pipeline", cluster(2), {"schedule": "zbv"})
