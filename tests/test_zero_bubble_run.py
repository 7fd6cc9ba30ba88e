"""Zero-bubble schedules run for real (issues 30 and 31): devplace's "zero-bubble", "zbv" and "dualpipev" run under
torch's ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV in CPU processes over gloo, each
process in the order devplace simulates, with the loss and every gradient of the unpipelined step -- in a pipeline
export (V chunks per process; two in a V) and in a dp x pp plan (ZB-H1, ZBV); tests/test_zero_bubble.py compares
the orders torch plans with the simulator's, without processes.
torch's split backward needed four fixes on traced stages (`pipeline_run.split_backward`), found on these
models: BART (relayed outputs are views; two parameter groups share a node; parameters in no group), ViT (a
non-contiguous input gradient; an output the stage saved)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import run_cli
from devplace.graph.parallel import ParallelPlan, runtime_gap
from devplace.runtime import plan
from devplace.runtime.export import ExportError, pipeline_split
from devplace.runtime.parallel_export import parallel_export
from devplace.runtime.parallel_run import run_parallel
from devplace.runtime.pipeline_run import PipelineRunError, accumulated_step, run_pipeline
from devplace.runtime.plan import load_plan
from devplace.sim.schedule import BACKWARD, FORWARD, FULL, WEIGHT, Schedule, actions
from devplace.zoo import tiny
from test_parallel_run import _net
from test_pipeline_run import timeline_holds

PHASE = {"F": FORWARD, "I": BACKWARD, "W": WEIGHT, "B": FULL}


def _ran_order(ran_actions: list[str], p: int) -> list[tuple[int, int, int]]:
    """The actions a run's process reports (torch's strings, "3I0"; "B" a whole backward) as devplace's tuples
    (chunk = stage // p: the round of an interleaved pipeline, the way back of a V)."""
    from torch.distributed.pipelining.schedules import _Action

    acts = [_Action.from_str(a) for a in ran_actions]
    return [(PHASE[a.computation_type.value], a.stage_index // p, a.microbatch_index) for a in acts]


def _runs_like_its_step(arch: str, cluster: str, m: int, chunks: int):
    """Place `arch` with the pipeline placer under zero-bubble, export it through JSON, run it: the loss and every
    gradient equal the unpipelined step's, and each process ran the actions devplace simulated."""
    model, inputs = getattr(tiny, arch)()
    p = plan(model, inputs, cluster, placer="pipeline", schedule="zero-bubble", microbatches=m, chunks=chunks)
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    assert split.schedule == Schedule("zero-bubble", m, chunks, True) and split.moved_fraction == 0.0
    assert split.pipelined_step_time_s == p.result.step_time_s
    ran = run_pipeline(model, inputs, json.loads(json.dumps(split.to_dict())), return_grads=True)
    procs = p.cluster.num_devices
    assert ran.processes == procs and len(split.devices) == procs * chunks
    for r in range(procs):
        assert _ran_order(ran.actions[r], procs) == actions(ran.schedule, procs, r)
    timeline_holds(ran, ran.actions)  # each action timed where it ran, I and W apart
    loss, grads = accumulated_step(model, inputs)
    assert ran.losses[0] == pytest.approx(loss, rel=1e-5)
    assert set(grads) <= set(ran.grads)
    for name, grad in grads.items():
        torch.testing.assert_close(ran.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_encoder_decoder_runs_interleaved_zero_bubble_like_its_step():
    """BART in 6 stages on 3 processes: stages whose outputs are relays (views), a stage where two of torch's
    parameter groups share a node (W died: 'backward through the graph a second time'), and a stage whose
    decoder embeddings meet no input that needs a gradient (W left them without one, silently)."""
    _runs_like_its_step("bart", "3xGPU-placeto", 2, 2)


def test_a_zero_bubble_plan_goes_from_place_to_export_and_run(tmp_path, capsys, monkeypatch):
    """ZB-H1 through the command line: `place --schedule zero-bubble`, `export --format pipeline`, `run
    --pipeline`. A ViT stage sends a transposed input gradient (gloo refused it: 'input tensor has to be
    contiguous') and saves an output its W reads (which torch's I detaches)."""
    plan_path, export_path = tmp_path / "plan.json", tmp_path / "pipe.json"
    model = "devplace.zoo.tiny:vit"
    code, out, err = run_cli(["place", "--model", model, "-c", "2xK80", "--placer", "pipeline", "--schedule",
                              "zero-bubble", "--chunks", "1", "--microbatches", "4", "--save-plan", str(plan_path)],
                             capsys, monkeypatch)
    assert code == 0, err
    code, out, err = run_cli(["export", str(plan_path), "--format", "pipeline", "-o", str(export_path)], capsys,
                             monkeypatch)
    assert code == 0, err
    doc = json.loads(export_path.read_text())
    assert doc["schedule"]["kind"] == "zero-bubble" and doc["schedule"]["chunks"] == 1
    code, out, err = run_cli(["export", str(plan_path), "--format", "parallel", "--dp", "1", "-o",
                              str(tmp_path / "par.json")], capsys, monkeypatch)
    assert code == 0, err
    par = json.loads((tmp_path / "par.json").read_text())["parallel"]
    assert (par["schedule"], par["chunks"], par["pp"]) == ("zero-bubble", 1, 2)  # ZB-H1, not 2 chunks
    code, out, err = run_cli(["export", str(plan_path), "--format", "pipeline", "--microbatches", "8", "-o",
                              str(tmp_path / "more.json")], capsys, monkeypatch)
    assert code == 0, err  # M=8 on 2 devices: 4 rounds of 2
    code, out, err = run_cli(["export", str(plan_path), "--format", "parallel", "--schedule", "zbv", "-o",
                              str(tmp_path / "v.json")], capsys, monkeypatch)
    assert code == 2 and "placed with 2 chunks per device out as a V" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(["run", "--pipeline", str(export_path), "--model", model, "--steps", "1", "--warmup", "0",
                              "--json"],
                             capsys, monkeypatch)
    assert code == 0, err
    ran = json.loads(out)
    assert ran["processes"] == 2 and ran["schedule"]["kind"] == "zero-bubble"
    assert ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)


def test_a_two_chunk_plan_exports_as_a_v(tmp_path, capsys, monkeypatch):
    """`place --schedule zero-bubble --chunks 2` then `export --format parallel --schedule zbv|dualpipev`: the same 4
    stages, laid out as a V on the 2 devices (run by hand: `run --parallel` of both gave the one-process loss,
    1.65268, on this ViT); DualPipeV's M >= 2p is checked when exporting."""
    plan_path = tmp_path / "plan.json"
    code, _, err = run_cli(["place", "--model", "devplace.zoo.tiny:vit", "-c", "2xK80", "--placer", "pipeline",
                            "--schedule", "zero-bubble", "--chunks", "2", "--microbatches", "4", "--save-plan",
                            str(plan_path), "--quiet"], capsys, monkeypatch)
    assert code == 0, err
    placed = load_plan(plan_path)
    cuts = pipeline_split(placed.graph, placed.placement).to_dict()["split_points"]
    for kind in ("zbv", "dualpipev"):
        code, _, err = run_cli(["export", str(plan_path), "--format", "parallel", "--schedule", kind, "-o",
                                str(tmp_path / f"{kind}.json")], capsys, monkeypatch)
        assert code == 0, err
        doc = json.loads((tmp_path / f"{kind}.json").read_text())
        assert (doc["parallel"]["schedule"], doc["parallel"]["pp"], doc["parallel"]["chunks"]) == (kind, 2, 2)
        assert doc["split_points"] == cuts and len(cuts) == 3  # the placement's 4 stages
        assert [st["devices"] for st in doc["stages"]] == [[0], [1], [1], [0]]
    code, _, err = run_cli(["export", str(plan_path), "--format", "parallel", "--schedule", "dualpipev",
                            "--microbatches", "2", "-o", str(tmp_path / "short.json")], capsys, monkeypatch)
    assert code == 2 and "use M >= 4 or zbv" in err
    code, _, err = run_cli(["export", str(plan_path), "--format", "pipeline", "--schedule", "zbv", "-o",
                            str(tmp_path / "pipe.json")], capsys, monkeypatch)
    assert code == 2 and "as --format parallel --schedule zbv" in err  # a placement alone cannot hold the V
    code, _, err = run_cli(["place", "--model", "devplace.zoo.tiny:vit", "-c", "2xK80", "--placer", "pipeline",
                            "--schedule", "dualpipev"], capsys, monkeypatch)  # refused before the capture, saying how
    assert code == 2 and "drop --placer" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("kind", "points", "checkpointed"), [
    ("zero-bubble", ["blocks.2"], [["blocks.0", "blocks.1"], []]),
    ("zbv", ["blocks.1", "blocks.2", "blocks.3"], [["blocks.0", "blocks.3"], []])])
def test_two_replicas_of_a_zero_bubble_pipeline_match_the_one_process_step(kind: str, points: list[str],
                                                                         checkpointed: list[list[str]]):
    """dp=2 x pp=2 in 4 processes under ZB-H1 (a stage per process) and ZBV (two per process, in a V: process s of a
    replica holds stages s and 3 - s), ZeRO-1 and per-block recomputation at position 0 (under ZBV both its stages
    checkpointed), ZeRO-2 (fully_shard, of both stage modules under ZBV) at position 1: the loss and every gradient
    of the first step and the loss after the update match one process. ZeRO-3 under a zero-bubble schedule, whose
    gradients torch gets wrong, is refused before anything runs."""
    model, inputs = _net()  # test_parallel_run's four-block net, seeded
    chunks = 1 if kind == "zero-bubble" else 2
    plan_ = ParallelPlan(dp=2, pp=2, microbatches=2, batch=8, schedule=kind, chunks=chunks, zero=(1, 2),
                         recompute=("full", "none"))
    assert runtime_gap(plan_) is None
    ran = run_parallel(model, inputs, parallel_export(plan_, points), steps=2, return_grads=True)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, foreach=False)
    loss = ref(*inputs)
    loss.backward()
    for name, param in ref.named_parameters():
        torch.testing.assert_close(ran.grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    first = loss.item()
    opt.step()
    assert ran.losses == pytest.approx([first, ref(*inputs).item()], rel=1e-5)
    assert [s["sharded"] for s in ran.setups] == [False, True, False, True]
    assert [s["checkpointed"] for s in ran.setups] == checkpointed * 2
    zero3 = ParallelPlan(dp=2, pp=2, microbatches=2, batch=8, schedule=kind, chunks=chunks, zero=(0, 3))
    assert runtime_gap(zero3) == f"ZeRO-3 under the {kind} schedule"
    with pytest.raises(PipelineRunError, match=f"does not run ZeRO-3 under the {kind} schedule"):
        run_parallel(model, inputs, parallel_export(zero3, points))
    with pytest.raises(ExportError, match=r"pipeline stages \(pp=2, .*\) is cut at"):
        parallel_export(zero3, points[:1] * 2)


@pytest.mark.parametrize(("kind", "m"), [("zbv", 2), ("dualpipev", 4)])
def test_v_schedules_run_like_their_step_in_the_order_simulated(kind: str, m: int):
    """ZBV and DualPipeV: 4 stages in a V on 2 processes (stages 0 and 3 on the first, 1 and 2 on the second,
    which hands its values over in memory at the turn; torch's warm-up sent to its own process, which gloo
    refused: 'Pair is not connected'). The loss and every gradient equal the one-process step's, and each process
    ran, in order, the actions devplace simulates (DualPipeV's overlapped pairs as their two actions)."""
    model, inputs = _net()
    schedule = Schedule(kind, m, microbatch_graph=True)
    doc = {"format": "devplace.pipeline/2", "stage_devices": [0, 1, 1, 0], "schedule": schedule.to_dict(),
           "split_points": [{"module": f"blocks.{i}", "point": "beginning"} for i in (1, 2, 3)]}
    ran = run_pipeline(model, inputs, doc, return_grads=True)
    for r in range(2):
        assert _ran_order(ran.actions[r], 2) == actions(schedule, 2, r)
    assert any("B" in a for a in ran.actions[0]) == (kind == "dualpipev")  # whole backwards: DualPipeV's only
    loss, grads = accumulated_step(model, inputs)
    assert ran.losses[0] == pytest.approx(loss, rel=1e-5)
    assert set(grads) <= set(ran.grads)
    for name, grad in grads.items():
        torch.testing.assert_close(ran.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ExportError, match="stages s and 2p - 1 - s on one device"):
        run_pipeline(model, inputs, {**doc, "stage_devices": [0, 1, 0, 1]})
    # torch's DualPipeV refuses fewer micro-batches than stages; devplace says so before starting any process
    short = {**doc, "schedule": Schedule("dualpipev", 2, microbatch_graph=True).to_dict()}
    with pytest.raises(PipelineRunError, match="dualpipev runs at least as many micro-batches as stages: 2"):
        run_pipeline(model, inputs, short)
