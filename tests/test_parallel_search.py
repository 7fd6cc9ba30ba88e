"""Parallel plans in the one search (issue 31, the search and CLI part): `search_placement(..., parallel=)` nests
`search_parallel` with the dimensions a request leaves open, `devplace place --dp/--pp/--zero/--recompute/
--parallel` reaches it, the answer records its `ParallelPlan`, and `devplace run` refuses what it cannot run."""

from __future__ import annotations

import json

import numpy as np
import pytest

import devplace
from conftest import cluster
from conftest import run_cli as run
from devplace.graph.parallel import RUN_SCHEDULES, ParallelAsk, ParallelPlan, ParallelPlanError, runtime_gap
from devplace.graph.placement import load_placement
from devplace.hardware.cluster import load_cluster
from devplace.placers import search_placement
from devplace.placers.parallel import search_parallel
from devplace.placers.registry import PlacerError
from devplace.placers.search import parallel_degrees, parallel_microbatches
from devplace.sim.parallel import CATEGORIES, simulate_parallel
from devplace.study import runner
from devplace.study.grid import Cell
from devplace.study.spec import ClusterRef, GraphRef, StudyError, load_study
from test_sim_parallel import model, stages_of

BATCH = 8


def captured(m: int = 1):
    """The 4-layer model of test_placer_parallel "captured" at BATCH / m (its costs do not change with the size)."""
    meta = {"capture": {"batch": BATCH // m}, **({"microbatches": m} if m > 1 else {})}
    return model(4, param=8e9, meta=meta)


def provider(m: int):
    return captured(m), None


def test_the_search_nests_search_parallel_with_what_the_request_leaves_open() -> None:
    c = cluster(4, bw=1e10, mem=2e10)  # a whole replica (32 GB) fits only sharded
    found = search_placement(captured(), c, microbatch_graph=provider, parallel=ParallelAsk())
    # every dp of the 4 devices, K = 4 micro-batches of 2 samples: the nested search on that capture
    direct = search_parallel(captured(4), c, batch=BATCH, microbatch_size=2)
    assert found.parallel is not None
    plan = found.parallel.plan
    assert plan == direct.best.plan and found.parallel.step_time_s == direct.best.step_time_s
    assert plan.dp == 4 and plan.zero == (3,)
    # the answer is the plan's: its step, memory per device by category, replica 0 placed under its schedule
    assert found.result.step_time_s == found.parallel.step_time_s and found.result.feasible
    assert [float(found.result.peak_memory_bytes[m.device]) for m in found.parallel.memory] == \
        [m.total for m in found.parallel.memory]
    assert found.placement.meta["parallel"] == plan.to_dict()
    assert ParallelPlan.from_dict(found.placement.meta["parallel"]) == plan
    # replayed from what the placement records: its plan, and replica 0's device per op (the stages)
    saved = ParallelPlan.from_dict(json.loads(json.dumps(found.placement.to_dict()))["parallel"])
    position = {d: s for s, d in enumerate(saved.replica(0))}
    stage = np.array([position[d] for d in found.placement.to_array(found.graph, 4)], dtype=np.int64)
    assert simulate_parallel(found.graph, c, stage, saved).step_time_s == found.parallel.step_time_s
    assert found.placement.schedule == plan.pipeline_schedule(0, microbatch_graph=True)
    tried = found.placement.meta["parallel_search"]["tried"]
    # both micro-batch sizes the batch allows on 4 devices (2 and 1 samples), the second's degrees skipped where
    # their bound is not below the first's plan (`search_parallel`'s beat); 2 kept
    direct_1 = search_parallel(captured(8), c, batch=BATCH, microbatch_size=1, beat=direct.best.step_time_s)
    assert len(tried) == len(direct.candidates) + len(direct_1.candidates)
    assert any(str(why).startswith("skipped: no plan beats") for why in tried.values())
    assert found.placement.meta["parallel_search"]["microbatch_size"] == 2
    # fixed dimensions are the only ones tried
    fixed = search_placement(captured(), c, microbatch_graph=provider,
                             parallel=ParallelAsk(dp=2, zero=1, recompute="full"))
    assert fixed.parallel is not None
    p = fixed.parallel.plan
    assert (p.dp, p.pp, p.zero, p.recompute) == (2, 2, (1, 1), ("full", "full"))
    tried = fixed.placement.meta["parallel_search"]["tried"]
    assert all(label.startswith("dp=2 pp=2") and "zero=1 recompute=full" in label
               for label in tried if " pp=" in label)
    # the rest: DualPipeV at M = 2 (of 2 samples), fewer micro-batches than its 4 stages, not judged; and M = 4 (of 1
    # sample), whose bound is not below the plan kept at M = 2
    assert {label: why[:48] for label, why in tried.items() if " pp=" not in label} == {
        "dp=2 M=2 dualpipev": "dualpipev runs at least as many micro-batches as",
        "dp=2 M=4 1f1b/zero-bubble/zbv/dualpipev": "skipped: no plan beats 22.3 s (its lower bound i"}


def test_the_search_says_what_a_parallel_request_cannot_do() -> None:
    c = cluster(4, bw=1e10, mem=2e10)
    with pytest.raises(PlacerError, match=r"need a model captured here \(--model NAME\)"):
        search_placement(captured(), c, parallel=ParallelAsk())
    with pytest.raises(PlacerError, match="drop --placer, --order"):
        search_placement(captured(), c, placer="m-etf", order="bfs", microbatch_graph=provider,
                         parallel=ParallelAsk(dp=2))
    with pytest.raises(ParallelPlanError, match=r"--dp 3 does not divide the cluster's 4 devices .* one of 1, 2, 4"):
        search_placement(captured(), c, microbatch_graph=provider, parallel=ParallelAsk(dp=3))


def test_degrees_and_microbatches_resolved() -> None:
    assert parallel_degrees(ParallelAsk(), 16, 32) == (1, 2, 4, 8, 16)
    assert parallel_degrees(ParallelAsk(zero=1), 4, 8) == (2, 4)
    assert parallel_degrees(ParallelAsk(pp=4), 16, 32) == (4,)
    assert parallel_degrees(ParallelAsk(), 16, 8) == (1, 2, 4, 8)
    with pytest.raises(ParallelPlanError, match=r"--dp 2 x --pp 4 = 8 devices, and the cluster has 16"):
        parallel_degrees(ParallelAsk(dp=2, pp=4), 16, 32)
    with pytest.raises(ParallelPlanError, match=r"--pp 4 leaves dp = 1"):
        parallel_degrees(ParallelAsk(pp=4, zero=2), 4, 8)
    with pytest.raises(PlacerError, match=r"dp = 4 replicas do not split the batch of 6"):
        parallel_degrees(ParallelAsk(dp=4), 4, 6)
    with pytest.raises(PlacerError, match=r"no data-parallel degree above 1 divides both the 4 devices and the batch"):
        parallel_degrees(ParallelAsk(zero=1), 4, 3)
    # from micro-batches that keep every device busy, halved while the batch allows, 3 sizes at most
    assert parallel_microbatches(32, 16, (1, 2, 4, 8, 16)) == (16, 32)  # micro-batches of 2 and 1
    assert parallel_microbatches(32, 8, (1, 2, 4, 8)) == (8, 16, 32)
    assert parallel_microbatches(256, 8, (1, 2, 4, 8)) == (8, 16, 32)
    assert parallel_microbatches(8, 4, (1, 2, 4)) == (4, 8)
    assert parallel_microbatches(8, 16, (1, 2, 4, 8)) == (8,)  # fewer samples than devices: the largest count
    assert parallel_microbatches(6, 4, (2,)) == (6,)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"zero": 4}, "--zero must be one of 0, 1, 2, 3"),
    ({"recompute": "some"}, "--recompute must be one of none, full, auto"),
    ({"dp": 1, "zero": 2}, "--dp 1 has none to shard over"),
    ({"dp": 0}, "dp must be an integer >= 1"),
])
def test_asks_are_checked(kwargs, match) -> None:
    with pytest.raises(ParallelPlanError, match=match):
        ParallelAsk(**kwargs)


def test_what_the_runtime_runs_of_a_plan() -> None:
    from devplace.runtime.parallel_run import SCHEDULES

    assert RUN_SCHEDULES == SCHEDULES  # the one list graph/ may not import
    assert runtime_gap(ParallelPlan(1, 2, 2, 2, "1f1b")) is None
    assert runtime_gap(ParallelPlan(1, 1, 2, 2, "none")) is None
    assert runtime_gap(ParallelPlan(2, 2, 2, 8, "1f1b", zero=(1, 3), recompute="full")) is None  # parallel_run
    assert runtime_gap(ParallelPlan(2, 2, 2, 8, "zero-bubble", chunks=1, zero=1, recompute="full")) is None  # ZB-H1
    assert runtime_gap(ParallelPlan(2, 2, 2, 8, "zero-bubble", chunks=1, zero=(0, 3))) == (
        "ZeRO-3 under the zero-bubble schedule")  # torch's split backward of a resharded stage: wrong gradients
    assert runtime_gap(ParallelPlan(2, 2, 2, 8, "zero-bubble", zero=1)) == (
        "2 chunks per device (a dp x pp run runs one stage per process, or two in a V)")
    assert runtime_gap(ParallelPlan(1, 2, 2, 2, "zero-bubble")) is None  # no replicas: runs as a pipeline export
    assert runtime_gap(ParallelPlan(2, 2, 2, 8, "zbv", zero=(1, 2), recompute="full")) is None  # two stages a process
    assert runtime_gap(ParallelPlan(2, 2, 4, 16, "dualpipev", zero=(0, 3))) == "ZeRO-3 under the dualpipev schedule"
    assert runtime_gap(ParallelPlan(2, 2, 2, 8, "interleaved-1f1b")) == "the interleaved-1f1b schedule"


def test_one_table_view_of_a_plan() -> None:
    g, c = model(4, param=8.0, meta={"microbatches": 2}), cluster(4, bw=100.0)
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, batch=8, zero=1)
    r = simulate_parallel(g, c, stages_of(g, 2), plan)
    view = r.as_sim_result()
    assert view.step_time_s == r.step_time_s
    for m in r.memory:
        assert view.peak_memory_bytes[m.device] == m.total
        assert m.total == pytest.approx(sum(getattr(m, k) for k in CATEGORIES))
    # every replica's devices are busy, not only replica 0's
    assert np.all(view.device_busy_s[list(plan.devices)] > 0)


TOWER = '''
import torch
from torch import nn


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def build(batch=8):
    torch.manual_seed(0)
    return Tower(), torch.randn(batch, 16)
'''


def test_place_fixes_dimensions_reports_memory_and_run_refuses(python_package, tmp_path, capsys, monkeypatch):
    tower = python_package("psearch_pkg", TOWER) + ":build"
    out_file, plan_file = tmp_path / "p.json", tmp_path / "plan.json"
    code, out, err = run(["place", "--model", tower, "-c", "2xK80", "--dp", "2", "--zero", "1", "--recompute",
                          "full", "--json", "-o", str(out_file), "--save-plan", str(plan_file)], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    par = doc["parallel"]
    assert {k: par[k] for k in ("dp", "pp", "microbatches", "schedule", "zero", "recompute")} == \
        {"dp": 2, "pp": 1, "microbatches": par["microbatches"], "schedule": "none", "zero": [1], "recompute": ["full"]}
    assert par["plan"]["batch"] == 8 and par["plan"]["devices"] == [0, 1]
    assert par["devplace_run_runs_it"] and par["devplace_run_does_not_run"] is None
    assert [m["device"] for m in par["memory"]] == [0, 1]
    for m in par["memory"]:
        assert set(CATEGORIES) <= set(m) and m["total"] == pytest.approx(sum(m[k] for k in CATEGORIES))
    assert doc["peak_memory_bytes"] == [m["total"] for m in par["memory"]]
    assert load_placement(out_file).meta["parallel"] == par["plan"]  # the saved placement replays the plan
    # a study cell whose placer asks for the same parallel plans answers the same
    ref = GraphRef(spec=f"zoo:{tower}", family="zoo", name=tower)
    cell = Cell("k", "s", ref, ClusterRef("2xK80", "2xK80"), "devplace", None, "auto",
                json.dumps({"parallel": {"dp": 2, "zero": 1, "recompute": "full"}}), "auto", 0)
    row = runner.run_cell(cell, runner.prepare_graph(ref, None), load_cluster("2xK80"))
    assert row["status"] == "ok", row.get("error")
    assert row["step_time_s"] == doc["step_time_s"] and row["peak_memory_bytes"] == doc["peak_memory_bytes"]
    # and devplace.plan on the module itself
    module, inputs = __import__(tower.partition(":")[0], fromlist=["build"]).build()
    p = devplace.plan(module, (inputs,), "2xK80", parallel=ParallelAsk(dp=2, zero=1, recompute="full"))
    assert p.placement.meta["parallel"] == par["plan"] and p.result.step_time_s == doc["step_time_s"]
    # devplace run runs it: 2 replicas, ZeRO-1, recomputation (tests/test_parallel_run.py checks such runs)
    code, out, err = run(["run", "--plan", str(plan_file), "--steps", "1", "--warmup", "0", "--trust-model",
                          "--json"], capsys, monkeypatch)
    assert code == 0, err
    ran = json.loads(out)
    assert ran["processes"] == 2 and ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)
    # the text report shows memory by category
    code, out, err = run(["place", "--model", tower, "-c", "2xK80", "--dp", "2", "--zero", "1"], capsys, monkeypatch)
    assert code == 0, err
    assert "parallel plan: dp=2 pp=1 none" in out and "optimizer" in out and "stash" in out
    # the headline's transfers are replica 0's, and it says so (its "0 B moved in 0 transfers" read as no sync)
    headline = "moved in 0 transfers within replica 0 (the step includes the 2 replicas' gradient sync)"
    assert headline in " ".join(out.split())


@pytest.mark.parametrize(("args", "match"), [
    (["--dp", "3"], "--dp 3 does not divide the cluster's 2 devices"),
    (["--zero", "5"], "--zero must be one of 0, 1, 2, 3"),
    (["--recompute", "half"], "--recompute must be one of none, full, auto"),
])
def test_place_refuses_bad_dimensions_before_capturing(args, match, capsys, monkeypatch):
    code, _out, err = run(["place", "--model", "no-such-model", "-c", "2xK80", *args], capsys, monkeypatch)
    assert code == 2 and match in err, err


def test_a_graph_file_has_no_parallel_plans(capsys, monkeypatch):
    code, _out, err = run(["place", "example", "-c", "2xK80", "--parallel"], capsys, monkeypatch)
    assert code == 2 and "need a model captured here" in err, err



def test_simulating_replica_0_of_a_plan_warns(tmp_path, capsys, monkeypatch):
    from devplace.graph import save_graph
    from devplace.graph.placement import Placement, save_placement

    g = model(2)
    plan = ParallelPlan(dp=2, pp=1, microbatches=1, batch=2, schedule="none")
    save_graph(g, tmp_path / "g.json")
    save_placement(Placement.from_array(g, [0] * g.num_nodes, "2xK80").with_meta(parallel=plan.to_dict()),
                   tmp_path / "p.json")
    code, _out, err = run(["simulate", str(tmp_path / "g.json"), "2xK80", str(tmp_path / "p.json")], capsys,
                          monkeypatch)
    assert code == 0 and "is replica 0 of a parallel plan" in " ".join(err.split()), err


@pytest.mark.parametrize(("table", "match"), [
    ("parallel = { dp = 2, zero = 1 }", None),
    ("parallel = { dp = 2, zeros = 1 }", r"parallel: unknown key\(s\) 'zeros'"),
    ("parallel = { zero = 7 }", "--zero must be one of 0, 1, 2, 3"),
    ("parallel = 2", "must be a table of dp, pp, zero, recompute"),
])
def test_a_study_placer_asks_for_parallel_plans(table, match, tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(f'name = "s"\ngraphs = ["cifar10/0"]\nclusters = ["2xK80"]\norders = ["auto"]\n'
                    f'[[placers]]\nname = "auto"\n{table}\n')
    if match is None:
        assert load_study(path).placers[0].settings == {"parallel": {"dp": 2, "zero": 1}}
    else:
        with pytest.raises(StudyError, match=match):
            load_study(path)


def test_the_default_searches_the_parallel_plans_devplace_runs_and_run_runs_its_answer(python_package, capsys,
                                                                                       monkeypatch):
    # issue 31: placer auto on a captured model tries parallel plans beside the pipelines and the placement without
    # micro-batches, under the schedules the runtime runs only; at a batch of 4096 two replicas win on 2xK80
    tower = python_package("pdefault_pkg", TOWER) + ":build"
    code, out, err = run(["place", "--model", tower, "--batch", "4096", "-c", "2xK80", "--json"], capsys,
                         monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    tried = doc["placer_auto"]["tried"]
    assert {"parallel", "unpipelined", "pipeline 1f1b"} <= set(tried)
    assert doc["step_time_s"] == tried["parallel"] == min(t for t in tried.values() if isinstance(t, float))
    assert doc["parallel"]["dp"] == 2 and doc["parallel"]["devplace_run_runs_it"]
    # the report's bound and baselines are the whole batch's: the bound holds, one device runs all 4096 samples
    assert doc["lower_bound_s"] <= doc["step_time_s"] < doc["best_single_device"]["step_time_s"]
    judged = doc["parallel"]["search"]["tried"]
    assert judged and all(any(k in label for k in RUN_SCHEDULES) or " none" in label for label in judged)
    # an order the parallel plans do not cut in leaves them out, and says why
    code, out, err = run(["place", "--model", tower, "--batch", "4096", "-c", "2xK80", "--order", "bfs", "--json"],
                         capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["placer_auto"]["tried"]["parallel"].startswith("skipped: parallel plans choose")
    # devplace run --model places the same and runs the parallel answer in dp * pp processes
    code, out, err = run(["run", "--model", tower, "--batch", "4096", "-c", "2xK80", "--steps", "1", "--warmup",
                          "0", "--json"], capsys, monkeypatch)
    assert code == 0, err
    ran = json.loads(out)
    assert ran["parallel"] == doc["parallel"]["plan"] and ran["processes"] == 2
    assert ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)


def test_parallel_plans_do_not_depend_on_the_order_the_devices_are_listed_in() -> None:
    # two fast and two slow GPUs, listed two ways: the same plan on the same GPUs, the same step (issue 29's
    # peers rerun found the default's answer moving with the listing through the parallel search)
    from devplace.hardware.cluster import reordered

    listed = cluster(4, bw=1e10, mem=2e10, speeds=[1.0, 2.0, 1.0, 2.0])
    perm = np.array([1, 3, 0, 2])
    other = reordered(listed, perm)  # device i of `other` is device perm[i] of `listed`
    a = search_placement(captured(), listed, microbatch_graph=provider, parallel=ParallelAsk())
    b = search_placement(captured(), other, microbatch_graph=provider, parallel=ParallelAsk())
    assert a.parallel is not None and b.parallel is not None
    assert b.parallel.step_time_s == pytest.approx(a.parallel.step_time_s, rel=1e-12)
    assert [int(perm[d]) for d in b.parallel.plan.devices] == list(a.parallel.plan.devices)
