"""Placer auto compares pipelined and unpipelined placements (issue 21, item 2): on a graph whose batch can be
split it places the step without micro-batches and as a pipeline and keeps the faster, says what it compared, and
`schedule="none"` keeps it to placements without micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devplace.app.with_torch import place_prepared, prepare_model
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.defaults import AUTO_PIPELINE, AUTO_PLACERS
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.placers import place
from devplace.placers.search import auto_candidates

NETS = '''
import torch
from torch import nn


def build(batch=8):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())], nn.Linear(512, 4))
    return model, torch.randn(batch, 512)


def chain(batch=2048):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), *[nn.Tanh() for _ in range(24)])
    return model, torch.randn(batch, 1024)
'''


@pytest.fixture
def mlp(python_package):
    return python_package("auto_pkg", NETS) + ":build"


def _graph(batch: int) -> CompGraph:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 4))
    return prepare(capture(model, (torch.randn(batch, 64),), loss_fn=lambda out: out.square().mean())).full


def _slow_links(n: int = 2) -> Cluster:
    return Cluster("two", tuple(Device(f"d{i}", 1e9, kind="V100") for i in range(n)), Link(1e8, 1e-5))


def test_auto_compares_a_pipeline_where_the_batch_can_be_split():
    g = _graph(8)
    assert auto_candidates(g, None, devices=4) == (*AUTO_PLACERS, AUTO_PIPELINE)
    assert auto_candidates(g, "none", devices=4) == AUTO_PLACERS
    assert auto_candidates(g, "interleaved-1f1b", devices=4) == (AUTO_PIPELINE,)
    assert auto_candidates(_graph(1), None, devices=4) == AUTO_PLACERS  # one sample: no micro-batches
    p = place(g, _slow_links(), order="topo")
    tried = p.meta["placer_auto"]["tried"]
    assert set(tried) == {*AUTO_PLACERS, AUTO_PIPELINE}
    assert p.meta["step_time_s"] == min(t for t in tried.values() if isinstance(t, float))
    flat = place(g, _slow_links(), order="topo", schedule="none")
    assert flat.schedule is None and AUTO_PIPELINE not in flat.meta["placer_auto"]["tried"]
    piped = place(g, _slow_links(), order="topo", schedule="gpipe")
    assert piped.schedule.kind == "gpipe"
    with pytest.raises(DevplaceError, match="schedule must be one of none, gpipe, 1f1b"):
        place(g, _slow_links(), schedule="zigzag")


def test_auto_on_a_captured_model_compares_unpipelined_and_pipelined_micro_batches(mlp):
    prepared = prepare_model(mlp, batch=8)
    cluster = _slow_links(4)
    placed = place_prepared(prepared, cluster, order="topo")
    meta = placed.placement.meta["placer_auto"]
    steps = {k: t for k, t in meta["tried"].items() if k in meta["time_s"]}
    # parallel plans too (issue 31): the canonical order is the one they cut in
    assert set(steps) == {"parallel", "unpipelined", "pipeline 1f1b", "pipeline interleaved-1f1b"}
    assert placed.result.step_time_s == min(t for t in steps.values() if isinstance(t, float))
    if placed.placement.schedule is not None:  # a pipeline kept: on micro-batches of their own size
        assert placed.placement.schedule.microbatch_graph or placed.placement.schedule.microbatches == 1
    text = " ".join(placed.text().split())
    assert "placer auto ->" in text and "pipeline 1f1b" in text
    flat = place_prepared(prepared, cluster, order="topo", settings={"schedule": "none"})
    assert flat.placement.schedule is None
    assert set(flat.placement.meta["placer_auto"]["time_s"]) == {"unpipelined"}
    assert flat.result.step_time_s == steps["unpipelined"]


def test_auto_skips_the_unpipelined_placers_when_their_lower_bound_is_not_below_a_pipeline(mlp):
    # fast links: the pipeline's step is below the unpipelined step's lower bound (DESIGN.md section 8; a chain of
    # tanh, its critical path all its compute), so the unpipelined placers never run (issue 29: they spent 309 of
    # 320 s of llama-1b b4's default search finding nothing within memory)
    from devplace.sim import lower_bound

    prepared = prepare_model(mlp.replace(":build", ":chain"), batch=2048)
    cluster = Cluster("fast", tuple(Device(f"d{i}", 1e9, kind="V100") for i in range(4)), Link(1e12, 0.0))
    placed = place_prepared(prepared, cluster, order="topo")
    meta = placed.placement.meta["placer_auto"]
    bound = lower_bound(prepared.full, cluster).value_s
    assert meta["tried"]["unpipelined"].startswith("skipped: no step without micro-batches beats")
    assert f"its lower bound is {bound:.4g} s" in meta["tried"]["unpipelined"]
    assert bound >= placed.result.step_time_s and placed.placement.schedule is not None
    assert not [e for e in placed.log if e.level == "placer" and e.placer in AUTO_PLACERS]
    assert next(iter(meta["tried"])) == "unpipelined"  # reported first, as before


class _Fork(nn.Module):
    """Two branches that orders walk differently; the pipeline can cut only around the whole block."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x)) * torch.tanh(self.b(x))


@pytest.mark.parametrize("cuts", ["modules", "ops"])
def test_order_auto_places_the_pipeline_once_per_forward_sequence(cuts):
    from devplace.orders import ORDERS, traversal_indices
    from devplace.placers.pipeline import forward_sequence

    torch.manual_seed(0)
    model = nn.Sequential(*[_Fork() for _ in range(4)], nn.Linear(32, 4))
    g = prepare(capture(model, (torch.randn(8, 32),), loss_fn=lambda out: out.square().mean())).full
    c = _slow_links(2)
    candidates = [o for o in ORDERS if o != "random"]
    p = place(g, c, placer="pipeline", order="auto", microbatches=4, cuts=cuts)
    tried = p.meta["order_auto"]["tried"]
    sequences = {forward_sequence(g, traversal_indices(g, o, 0, cluster=c)).tobytes() for o in candidates}
    assert len(sequences) == 3
    # cutting only at module starts, orders that differ inside the segments between them alone are placed once
    assert len(tried) == (1 if cuts == "modules" else len(sequences))
    assert "placed once" in p.meta["order_auto"]["why"]
    every = [place(g, c, placer="pipeline", order=o, microbatches=4, cuts=cuts).meta["step_time_s"]
             for o in candidates]
    assert p.meta["step_time_s"] == min(every)  # the orders left out could not have done better
    if cuts == "modules":
        assert len(set(every)) == 1


def test_auto_leaves_quadratic_placers_out_on_large_graphs_and_says_so(monkeypatch):
    import devplace.placers.search as search
    from devplace.planning import place_graph

    g = _graph(1)  # one sample: no pipeline candidate either
    monkeypatch.setattr(search, "AUTO_QUADRATIC_NODES", g.num_nodes - 1)
    p = place(g, _slow_links(), order="topo")
    meta = p.meta["placer_auto"]
    assert "greedy" not in meta["time_s"] and meta["tried"]["greedy"].startswith("skipped: its time grows")
    assert set(meta["time_s"]) == {"m-etf", "even-refine"}
    assert "greedy skipped" in " ".join(place_graph(g, _slow_links(), order="topo").text().split())
    monkeypatch.setattr(search, "AUTO_QUADRATIC_NODES", g.num_nodes)
    assert "greedy" in place(g, _slow_links(), order="topo").meta["placer_auto"]["time_s"]


def test_auto_limits_a_refining_placers_simulations_on_large_graphs_and_says_so(monkeypatch):
    import devplace.placers.search as search
    from devplace.planning import place_graph

    g = _graph(1)
    full = place_graph(g, _slow_links(), order="topo")
    assert not any(t.note for t in full.log)  # the default budget leaves a small graph's search alone
    evals = {}
    real = search.place_candidate

    def spy(req, placer, orders, settings, progress):
        evals[placer] = settings.get("max_evals")
        return real(req, placer, orders, settings, progress)

    monkeypatch.setattr(search, "place_candidate", spy)
    monkeypatch.setattr(search, "AUTO_SIMULATED_NODES", g.num_nodes * 60)
    monkeypatch.setattr(search, "AUTO_SIMULATED_NODES_FLOOR", 5)
    placed = place_graph(g, _slow_links(), order="topo")
    assert evals["even-refine"] == 60 and evals["m-etf"] is None
    (noted,) = [t for t in placed.log if t.note]
    assert noted.placer == "even-refine" and "limited to 60 simulations" in noted.note
    assert "even-refine limited to 60 simulations" in " ".join(placed.text().split())
    monkeypatch.setattr(search, "AUTO_SIMULATED_NODES", 1)
    place_graph(g, _slow_links(), order="topo")
    assert evals["even-refine"] == 5  # never below the floor


def test_the_report_says_how_many_simulations_the_answer_took():
    from devplace.planning import place_graph
    from devplace.sim import simulate
    from devplace.sim.count import counting

    g = _graph(8)
    with counting() as outer:
        with counting() as inner:
            simulate(g, _slow_links(), [0] * g.num_nodes)
        assert inner.runs == 1
    assert outer.runs == 1  # nested counts each see the run
    one = place_graph(g, _slow_links(), placer="m-etf", order="topo")
    assert one.simulations is not None and one.simulations >= 2  # m-etf's check and the final simulation
    many = place_graph(g, _slow_links(), order="auto")
    assert many.simulations > one.simulations
    assert many.to_dict()["simulations"] == many.simulations
    assert f"{many.simulations:,} simulations" in " ".join(many.text().split())


def test_the_report_says_when_micro_batches_are_costed_as_the_whole_batch_divided():
    from devplace.planning import place_graph

    g = _graph(8)  # the whole step: placed directly, a pipeline scales its ops by 1 / M
    placed = place_graph(g, _slow_links(), placer="pipeline", order="topo", microbatches=4)
    assert placed.to_dict()["microbatch_costs"] == "the whole batch's / M"
    assert "costed as the whole batch's / 4" in " ".join(placed.text().split())
    flat = place_graph(g, _slow_links(), placer="m-etf", order="topo")
    assert "microbatch_costs" not in flat.to_dict() and "micro-batches:" not in flat.text()
