"""The parallel plan value (DESIGN.md section 9b): validation, mesh layout, JSON form."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devplace.graph.parallel import SCHEDULES, ParallelPlan, ParallelPlanError
from devplace.graph.schedule import Schedule


def test_default_mesh_puts_a_stage_group_on_consecutive_devices() -> None:
    plan = ParallelPlan(dp=2, pp=4, microbatches=4, batch=32)
    assert plan.stage_group(0) == (0, 1)
    assert plan.stage_group(3) == (6, 7)
    assert plan.replica(0) == (0, 2, 4, 6)
    assert plan.replica(1) == (1, 3, 5, 7)
    assert plan.zero == (0,) * 4 and plan.recompute == ("none",) * 4
    assert plan.microbatch_size == 4 and plan.num_devices == 8


def test_explicit_mesh_is_row_major_dp_pp() -> None:
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, batch=8, devices=(3, 2, 1, 0), zero=(1, 2),
                        recompute=["full", "none"])
    assert plan.replica(0) == (3, 2) and plan.replica(1) == (1, 0)
    assert plan.stage_group(0) == (3, 1) and plan.stage_group(1) == (2, 0)
    assert plan.zero == (1, 2) and plan.recompute == ("full", "none")
    assert plan.label == "dp=2 pp=2 1f1b M=2 zero=1,2 recompute=full,none"


def test_recompute_a_number_of_blocks_per_stage() -> None:
    plan = ParallelPlan(dp=1, pp=3, microbatches=3, batch=3, recompute=[0, 2, "full"])
    assert plan.recompute == ("none", 2, "full")  # 0 blocks is no recomputation
    assert plan.recomputes and not ParallelPlan(dp=1, pp=2, microbatches=2, batch=2, recompute=0).recomputes
    assert plan.label == "dp=1 pp=3 1f1b M=3 zero=0 recompute=none,2,full"
    assert plan.to_dict()["recompute"] == ["none", 2, "full"]
    plan.check_blocks((0, 2, 0))  # "full" suits a stage of no blocks (it reruns the stage as one unit)
    with pytest.raises(ParallelPlanError, match="stage 1 recomputes 2 blocks but holds 1; give at most 1"):
        plan.check_blocks((4, 1, 4))


def test_pipeline_schedule_of_a_replica() -> None:
    plan = ParallelPlan(dp=2, pp=2, microbatches=4, batch=16, schedule="interleaved-1f1b")
    assert plan.pipeline_schedule(1, microbatch_graph=True) == Schedule("interleaved-1f1b", 4, 2, True, (1, 3))
    one = ParallelPlan(dp=4, pp=1, microbatches=2, batch=8, schedule="none")
    assert one.pipeline_schedule().kind == "1f1b"  # one device: forward then backward per micro-batch
    assert ParallelPlan(dp=1, pp=2, microbatches=2, batch=2, schedule="zbv").pipeline_schedule().chunks == 2
    dual = ParallelPlan(dp=1, pp=2, microbatches=4, batch=4, schedule="dualpipev").pipeline_schedule()
    assert (dual.kind, dual.chunks) == ("dualpipev", 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dp": 3, "pp": 1, "microbatches": 1, "batch": 8, "schedule": "none"}, "dp=3 replicas do not split"),
    ({"dp": 2, "pp": 2, "microbatches": 3, "batch": 8}, "M=3 micro-batches do not split a replica's batch of 4"),
    ({"dp": 2, "pp": 1, "microbatches": 1, "batch": 8}, "schedule '1f1b' with pp=1"),
    ({"dp": 1, "pp": 2, "microbatches": 2, "batch": 8, "schedule": "none"}, "schedule 'none' with pp=2"),
    ({"dp": 1, "pp": 2, "microbatches": 2, "batch": 8, "schedule": "pipedream"}, "unknown schedule"),
    ({"dp": 1, "pp": 2, "microbatches": 2, "batch": 8, "schedule": "zbv", "chunks": 3}, "two chunks"),
    ({"dp": 1, "pp": 2, "microbatches": 2, "batch": 8, "schedule": "1f1b", "chunks": 2}, "one chunk"),
    ({"dp": 1, "pp": 2, "microbatches": 3, "batch": 3, "schedule": "interleaved-1f1b"}, "multiple of 2"),
    ({"dp": 1, "pp": 2, "microbatches": 5, "batch": 5, "schedule": "zero-bubble"}, "in 2 equal rounds"),
    ({"dp": 1, "pp": 2, "microbatches": 3, "batch": 3, "schedule": "dualpipev"}, "use M >= 4 or zbv"),
    ({"dp": 1, "pp": 2, "microbatches": 2, "batch": 8, "zero": 1}, "dp=1 has none to shard over"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "zero": 4}, "zero must be one of"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "zero": (1, 2, 3)}, "3 values for 2 stages"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "recompute": "some"}, "recompute must be one of"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "recompute": -1}, "a number of blocks"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "recompute": (True, 1)}, "a number of blocks"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "recompute": 1.5}, "a number of blocks"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "devices": (0, 1, 2, 2)}, "4 distinct device"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "devices": (0, 1, 2)}, "4 distinct device"),
    ({"dp": 2, "pp": 2, "microbatches": 2, "batch": 8, "tp": 2}, "tensor parallelism is not built"),
    ({"dp": 0, "pp": 2, "microbatches": 2, "batch": 8}, "dp must be an integer >= 1"),
    ({"dp": True, "pp": 2, "microbatches": 2, "batch": 8}, "dp must be an integer"),
])
def test_bad_plans_say_what_is_wrong(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ParallelPlanError, match=match):
        ParallelPlan(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("doc", [None, [], {"dp": 1}, {"dp": 1, "pp": 1, "microbatches": 1, "batch": 1, "x": 0}])
def test_from_dict_refuses_other_documents(doc: object) -> None:
    with pytest.raises(ParallelPlanError, match="a parallel plan is an object"):
        ParallelPlan.from_dict(doc)


@st.composite
def plans(draw: st.DrawFn) -> ParallelPlan:
    dp, pp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    schedule = "none" if pp == 1 else draw(st.sampled_from([s for s in SCHEDULES if s != "none"]))
    m = pp * draw(st.integers(2 if schedule == "dualpipev" else 1, 3))  # dualpipev: M >= 2 pp
    batch = dp * m * draw(st.integers(1, 3))
    zero = draw(st.lists(st.integers(0, 3 if dp > 1 else 0), min_size=pp, max_size=pp))
    recompute = draw(st.lists(st.sampled_from(["none", "full"]) | st.integers(1, 6), min_size=pp, max_size=pp))
    devices = draw(st.permutations(range(dp * pp)))
    return ParallelPlan(dp=dp, pp=pp, microbatches=m, batch=batch, schedule=schedule, zero=tuple(zero),
                        recompute=tuple(recompute), devices=tuple(devices))


@given(plans())
@settings(max_examples=60, deadline=None)
def test_json_round_trip_and_mesh_covers_every_device_once(plan: ParallelPlan) -> None:
    doc = json.loads(json.dumps(plan.to_dict()))
    assert {"dp", "pp", "microbatches", "schedule", "zero", "recompute"} <= set(doc)
    assert ParallelPlan.from_dict(doc) == plan
    placed = [d for r in range(plan.dp) for d in plan.replica(r)]
    assert sorted(placed) == sorted(plan.devices or ())
    assert sorted(d for s in range(plan.pp) for d in plan.stage_group(s)) == sorted(placed)
