"""One search behind every entry point (issue 29, item 1): the same request through `devplace place --model`,
`devplace.plan`, a study cell and `devplace run --model` gives the same placement and step, pipelines placed on
micro-batches captured at their own size in each."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import devplace
from conftest import cluster, graph
from conftest import run_cli as run
from devplace.capture.pipeline import Prepared, prepare
from devplace.capture.torch_capture import capture
from devplace.defaults import AUTO_PLACERS, PARALLEL_PLACER
from devplace.errors import DevplaceError, FormatError
from devplace.graph import load_graph, save_graph
from devplace.graph.coarsen import coarsen
from devplace.graph.parallel import ParallelAsk
from devplace.hardware.cluster import load_cluster
from devplace.placers import get_placer, search_placement
from devplace.placers.search import replay_request
from devplace.planning import baselines, place_graph
from devplace.runtime.plan import load_plan, plan_from_placed, zoo_plan
from devplace.sim import Schedule, lower_bound, simulate
from devplace.study import runner
from devplace.study.grid import Cell, expand
from devplace.study.spec import ClusterRef, GraphRef, load_study
from devplace.units import fmt_time

NETS = '''
import torch
from torch import nn


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 256)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)])
        self.head = nn.Linear(256, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def build(batch=8):
    torch.manual_seed(0)
    return Tower(), torch.randn(batch, 64)
'''

CLUSTER = "2xK80"
# a study names its placers (not "auto"); 2 micro-batches: tiny layers cost their launch more than their work, so
# the pipeline placer would keep M=1, which 1F1B cannot run on 2 stages (run --model runs the plan)
PLACER, M = "pipeline", 2


@pytest.fixture
def tower(python_package):
    return python_package("one_search_pkg", NETS) + ":build"


def _searched(meta: dict) -> dict:
    """What the search compared (each candidate's and each micro-batch count's step or why it was dropped),
    without its times."""
    return {k: meta[k]["tried"] for k in ("placer_auto", "microbatch_search") if k in meta}


def test_the_same_request_gives_the_same_answer_through_every_entry_point(tower, tmp_path, capsys, monkeypatch):
    code, out, err = run(["place", "--model", tower, "-c", CLUSTER, "--placer", PLACER, "--microbatches", str(M),
                          "--json"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    assignment, step = doc["assignment"], doc["step_time_s"]
    searched = {k: doc[k]["tried"] for k in ("placer_auto", "microbatch_search") if k in doc}
    assert set(searched["microbatch_search"]) == {str(M)}
    # what was asked beside what the search made of it (order auto resolved; the placer's settings it took)
    assert doc["request"] == {"placer": PLACER, "order": "auto", "seed": 0, "settings": {"microbatches": M}}
    assert doc["order"] != "auto" and doc["settings"]["microbatches"] == M
    assert doc["schedule"]["microbatches"] == M and doc["microbatch_costs"] == "captured at the micro-batch size"

    # devplace.plan on the module itself: its micro-batches captured from the inputs cut to batch / M
    module, inputs = __import__(tower.partition(":")[0], fromlist=["build"]).build()
    p = devplace.plan(module, (inputs,), CLUSTER, placer=PLACER, microbatches=M)
    assert p.placement.assignment == assignment and p.result.step_time_s == step
    assert _searched(p.placement.meta) == searched

    # a study cell of the model (a study names zoo models; a custom one is built here as its ref would be)
    ref = GraphRef(spec=f"zoo:{tower}", family="zoo", name=tower)
    cell = Cell("k", "s", ref, ClusterRef(CLUSTER, CLUSTER), "devplace", None, PLACER,
                json.dumps({"microbatches": M}), "auto", 0)
    cached = tmp_path / "g.json"
    save_graph(runner.prepare_graph(ref, None), cached)  # through the study's graph cache
    placed = []
    real = runner.place_graph
    monkeypatch.setattr(runner, "place_graph", lambda *a, **k: placed.append(real(*a, **k)) or placed[-1])
    row = runner.run_cell(cell, load_graph(cached), load_cluster(CLUSTER))
    assert row["status"] == "ok", row.get("error")
    assert row["step_time_s"] == step and placed[0].placement.assignment == assignment
    assert _searched(placed[0].placement.meta) == searched

    # devplace run --model: the plan it runs is the same (a pipeline runs in one process per stage)
    plan_file = tmp_path / "plan.json"
    code, out, err = run(["run", "--model", tower, "--cluster", CLUSTER, "--devices", "cpu,cpu", "--placer", PLACER,
                          "--microbatches", str(M), "--steps", "1", "--warmup", "0", "--save-plan", str(plan_file),
                          "--record", str(tmp_path / "r.jsonl")],
                         capsys, monkeypatch)
    assert code == 0, err
    saved = load_plan(plan_file)
    assert saved.placement.assignment == assignment and saved.result.step_time_s == step
    assert _searched(saved.placement.meta) == searched


def test_the_default_request_gives_the_same_answer_through_place_plan_and_a_study_cell(tower, tmp_path, capsys,
                                                                                      monkeypatch):
    """Placer auto, order auto (the defaults), which a study now names too: the same answer, the same search."""
    code, out, err = run(["place", "--model", tower, "-c", CLUSTER, "--json"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    searched = {k: doc[k]["tried"] for k in ("placer_auto", "microbatch_search") if k in doc}
    assert {"unpipelined", "pipeline 1f1b"} <= set(searched["placer_auto"])
    module, inputs = __import__(tower.partition(":")[0], fromlist=["build"]).build()
    p = devplace.plan(module, (inputs,), CLUSTER)
    assert p.placement.assignment == doc["assignment"] and p.result.step_time_s == doc["step_time_s"]
    assert _searched(p.placement.meta) == searched
    study = tmp_path / "s.toml"
    study.write_text('name = "s"\ngraphs = ["cifar10/0"]\nclusters = ["2xK80"]\nplacers = ["auto"]\n'
                     'orders = ["auto"]\n')
    (cell,) = expand(load_study(study))  # a study names placer auto (and checks its one setting)
    ref = GraphRef(spec=f"zoo:{tower}", family="zoo", name=tower)
    cell = dataclasses.replace(cell, graph=ref, max_nodes=None)
    placed = []
    real = runner.place_graph
    monkeypatch.setattr(runner, "place_graph", lambda *a, **k: placed.append(real(*a, **k)) or placed[-1])
    row = runner.run_cell(cell, runner.prepare_graph(ref, None), load_cluster(CLUSTER))
    assert row["status"] == "ok", row.get("error")
    assert row["step_time_s"] == doc["step_time_s"] and placed[0].placement.assignment == doc["assignment"]
    assert _searched(placed[0].placement.meta) == searched
    study.write_text(study.read_text().replace('["auto"]\norders', '[{name = "auto", settings = {schedule = '
                                               '"zigzag"}}]\norders'))
    with pytest.raises(DevplaceError, match="schedule must be one of none, gpipe"):
        load_study(study)


# ------------------------------------------------------------------- item 2: one record of how it was made


def _mlp(batch: int = 16) -> Prepared:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64),
                          nn.ReLU(), nn.Linear(64, 8))
    return prepare(capture(model, (torch.randn(batch, 32),), optimizer="adam"), max_nodes=12)


def test_the_report_keeps_the_coarsening_the_search_placed_and_its_own_time_and_count():
    """A coarsening whose groups merged every tie class is refined by the search (placers.search, "Coarse
    views"): the Placed reports the finer coarsening it placed, not the one it was given; its time and
    simulation count are the search's (measured once)."""
    mlp = _mlp()
    coarse = coarsen(mlp.full, 2)
    peak = float(simulate(mlp.full, cluster(1, bw=1e12, lat=1e-9, mem=1e12),
                          np.zeros(mlp.full.num_nodes, dtype=np.int64)).peak_memory_bytes[0])
    c = cluster(3, bw=1e12, lat=1e-9, mem=0.7 * peak)  # the step fits three devices, not one
    found = search_placement(mlp.full, c, coarsening=coarse, placer="m-etf", order="topo")
    placed = place_graph(coarse.graph, c, placer="m-etf", order="topo", coarsening=coarse, full=mlp.full)
    assert placed.placement.meta["refined_groups"] == placed.coarsening.num_groups == placed.placed_groups > 2
    assert placed.placement.assignment == found.placement.assignment
    assert placed.simulations == found.simulations  # the same search, counted once, not again around it
    assert f"({placed.placed_groups} groups of {mlp.full.num_nodes} ops)" in " ".join(placed.text().split())


def test_a_saved_plan_records_the_placer_kept_with_the_settings_it_takes_and_replays_it(tmp_path):
    """Placer auto without micro-batches keeps one of its placers: the plan records that placer with the
    settings it took (not auto's `schedule`, which it does not take) beside the request, and placing the recorded
    placer, order, seed and settings gives the same placement and step."""
    prepared = _mlp()
    c = cluster(3, bw=1e12, lat=1e-9, mem=1e12)
    placed = place_graph(prepared.graph, c, coarsening=prepared.coarsening, full=prepared.full, schedule="none")
    path = tmp_path / "plan.json"
    plan_from_placed(placed).save(path)
    s = load_plan(path).settings
    assert s["request"] == {"placer": "auto", "order": "auto", "seed": 0, "settings": {"schedule": "none"}}
    assert s["placer"] in AUTO_PLACERS and set(s["placer_settings"]) <= set(get_placer(s["placer"]).settings)
    again = place_graph(prepared.graph, c, coarsening=prepared.coarsening, full=prepared.full, placer=s["placer"],
                        order=s["order"], seed=s["seed"], **s["placer_settings"])
    assert again.placement.assignment == placed.placement.assignment
    assert again.result.step_time_s == placed.result.step_time_s


def test_a_parallel_plan_records_the_search_that_made_it_and_its_request_replays(tower, tmp_path, capsys,
                                                                                 monkeypatch):
    """A parallel plan is made by the nested search, not by placer `single` with no settings (which replays as one
    device running everything); its record keeps the parallel plans asked for (--dp 2), so the saved request,
    asked again, gives the same answer, and the loaded plan says so."""
    p, _, _ = zoo_plan(tower, CLUSTER, parallel=ParallelAsk(dp=2))
    assert p.placed.parallel is not None and p.placed.placer == PARALLEL_PLACER
    assert p.placed.request["parallel"] == {"dp": 2, "pp": "auto", "zero": "auto", "recompute": "auto"}
    path = tmp_path / "plan.json"
    p.save(path)
    saved = load_plan(path)
    assert saved.settings["request"] == p.placed.request and saved.placed.made_by == replace(p.placed.made_by,
                                                                                             seconds=None)
    again, _, _ = zoo_plan(tower, CLUSTER, **replay_request(saved.settings["request"]))
    assert again.placement.assignment == p.placement.assignment
    assert again.result.step_time_s == saved.result.step_time_s == p.result.step_time_s
    text = " ".join(saved.summary(text=True).split())
    assert f"placer {PARALLEL_PLACER} (no order), seed 0, autograd" in text and "placer single" not in text
    # `devplace simulate PLAN` replays the whole step (replicas and their sync), as load_plan does
    code, out, err = run(["simulate", str(path), "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["step_time_s"] == p.result.step_time_s, err
    code, _, err = run(["simulate", str(path), CLUSTER], capsys, monkeypatch)
    assert code == 2 and "or a saved plan (devplace place --save-plan) alone" in err


def test_a_recorded_request_with_try_and_try_with_replays_the_same_answer():
    """The record keeps what order auto was asked to do (try the 3 most promising orders with greedy, then run
    contiguous once): asking the record again gives the same placement, step and decision."""
    prepared = _mlp()
    c = cluster(3, bw=1e9, lat=1e-6, mem=1e12)
    how = {"coarsening": prepared.coarsening, "full": prepared.full}
    placed = place_graph(prepared.graph, c, placer="contiguous", order="auto", try_orders=3, try_with="greedy", **how)
    assert placed.request == {"placer": "contiguous", "order": "auto", "seed": 0, "settings": {}, "try_orders": 3,
                              "try_with": "greedy"}
    again = place_graph(prepared.graph, c, **replay_request(placed.request), **how)
    assert again.placement.assignment == placed.placement.assignment and again.made_by == placed.made_by
    assert again.result.step_time_s == placed.result.step_time_s


def test_a_loaded_plan_keeps_the_record_of_how_it_was_made(tmp_path):
    """The groups placed, the request and the simulation count come back from the file (they were the graph's op
    count, an empty request and nothing); a plan whose settings were edited to disagree with its placement's record
    is refused."""
    prepared = _mlp()
    c = cluster(3, bw=1e12, lat=1e-9, mem=1e12)
    placed = place_graph(prepared.graph, c, coarsening=prepared.coarsening, full=prepared.full, placer="m-etf",
                         order="bfs")
    path = tmp_path / "plan.json"
    plan_from_placed(placed).save(path)
    loaded = load_plan(path).placed
    assert loaded.placed_groups == placed.placed_groups == prepared.coarsening.num_groups < placed.graph.num_nodes
    assert loaded.request == placed.request == {"placer": "m-etf", "order": "bfs", "seed": 0, "settings": {}}
    assert loaded.simulations == placed.simulations > 0
    assert f"{placed.placed_groups} groups of" in load_plan(path).summary(text=True)
    doc = json.loads(path.read_text())
    doc["settings"]["order"] = "topo"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"settings\.order is 'topo' but the placement records 'bfs'"):
        load_plan(path)


@pytest.mark.parametrize("captured", [False, True])
def test_the_reports_search_part_renders_from_the_search_log(captured, tower):
    """Placer auto's line (each candidate's step or why it was dropped) and the search's time (the whole search's
    and each candidate's) come from the log and the record, not from a copy in the placement's meta: the same text
    with that copy gone, and it agrees with what the meta records for the file."""
    if captured:
        placed = zoo_plan(tower, CLUSTER)[0].placed
    else:
        prepared = _mlp()
        placed = place_graph(prepared.graph, cluster(3, bw=1e12, lat=1e-9, mem=1e12), coarsening=prepared.coarsening,
                             full=prepared.full)
    meta = placed.placement.meta["placer_auto"]
    text = " ".join(placed.text().split())
    listed = ", ".join(f"{p} {fmt_time(t) if isinstance(t, float) else 'no fit'}" for p, t in meta["tried"].items())
    assert f"placer auto -> {meta['placer']} ({listed})" in text
    each = ", ".join(f"{p} {t:.2f} s" for p, t in meta["time_s"].items())
    assert f"{placed.simulations:,} simulations ({each})" in text
    bare = dataclasses.replace(placed, placement=placed.placement.with_meta(placer_auto=None))
    assert " ".join(bare.text().split()) == text


def _without(placed, *keys: str):
    """`placed` with the meta keys `keys` gone (the search's record of them for the file format)."""
    meta = {k: v for k, v in placed.placement.meta.items() if k not in keys}
    return dataclasses.replace(placed, placement=dataclasses.replace(placed.placement, meta=meta))


def test_the_micro_batch_and_order_lines_render_from_the_search_log(tower):
    """The pipeline placer over micro-batch counts with order auto: which counts were tried (each one's step or why
    it was skipped), where the orders were compared and which order was kept and why are read from the log (each
    entry names the micro-batch count it was placed at): the same lines with the meta's copies gone, and they agree
    with those copies."""
    placed = zoo_plan(tower, CLUSTER, placer="pipeline")[0].placed
    meta, auto = placed.placement.meta["microbatch_search"], placed.placement.meta["order_auto"]
    text = " ".join(placed.text().split())
    tried = ", ".join(f"M={m} {fmt_time(t) if isinstance(t, float) else 'skipped'}" for m, t in meta["tried"].items())
    assert f"split into M={meta['kept']} ({tried})" in text
    assert f"orders compared at M={meta['order_chosen_at']}" in text
    assert f"order auto -> {auto['order']} ({auto['why']})" in text
    assert " ".join(_without(placed, "microbatch_search", "order_auto").text().split()) == text


def test_order_auto_for_a_placer_that_walks_no_order_says_so():
    """heft ignores the order: the report said "order auto -> topo" above "placer heft (no order)"; the record and
    the report now agree that no order was walked."""
    prepared = _mlp()
    placed = place_graph(prepared.graph, cluster(3, bw=1e12, lat=1e-9, mem=1e12), coarsening=prepared.coarsening,
                         full=prepared.full, placer="heft")
    assert placed.order is None and placed.placement.meta["order_auto"]["order"] is None
    text = " ".join(placed.text().split())
    assert "order auto -> " not in text and "order auto: no order walked (placer 'heft' does not walk" in text


def test_a_loaded_plan_reports_how_it_was_found_as_the_search_did(tower, tmp_path):
    """The saved plan keeps the search's log: the loaded plan's report lists the same candidates, outcomes and
    seconds (the whole search's wall time is not recorded, and says so)."""
    p, _, _ = zoo_plan(tower, CLUSTER)
    path = tmp_path / "plan.json"
    p.save(path)
    loaded = load_plan(path).placed
    assert loaded.log == p.placed.log and loaded.log
    # the lines on how it was found: from placer auto's to the line on how it was placed
    text, again = (" ".join(x.text().split()).partition("placer auto -> ")[2].partition(" baselines: ")[0]
                   for x in (p.placed, loaded))
    took = f"took {p.placed.placement_time_s:.2f} s wall time"
    assert took in text and again == text.replace(took, "took a wall time not recorded")


# ------------------------------------------------------------------------------- item 5: honest reports


class _Wide(nn.Module):
    """Narrow layers on a large batch: the activations, not the parameters, fill the memory, so a whole batch needs
    far more of it than a micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _wide_plan(mem: float) -> devplace.runtime.Plan:
    torch.manual_seed(0)
    k80s = load_cluster(CLUSTER)
    two = dataclasses.replace(k80s, devices=tuple(dataclasses.replace(d, memory_bytes=mem) for d in k80s.devices))
    return devplace.plan(_Wide(), (torch.randn(2048, 32),), two, placer="pipeline", microbatches=4)


def test_a_pipelines_speed_up_is_against_one_device_running_the_whole_batch():
    p = _wide_plan(1e12)
    placed = p.placed
    assert placed.placement.schedule.microbatch_graph and placed.whole is not None
    whole = placed.whole
    single, even = placed.baselines
    alone = min(simulate(whole, p.cluster, np.full(whole.num_nodes, d, dtype=np.int64)).step_time_s for d in (0, 1))
    assert single.name == "best single device" and single.step_time_s == alone
    assert single.speedup(p.result.step_time_s) == alone / p.result.step_time_s
    assert even.step_time_s >= lower_bound(whole, p.cluster).value_s
    text = " ".join(placed.text().split())
    assert "best single device (gpu0)" in text
    assert f"took {placed.placement_time_s:.2f} s wall time" in text  # the search's wall time, captures included


def test_where_the_whole_batch_fits_no_device_the_report_says_so_and_names_its_reference():
    roomy = _wide_plan(1e12).placed
    whole, micro, sched = roomy.whole, roomy.graph, roomy.placement.schedule
    on0 = np.zeros(whole.num_nodes, dtype=np.int64)
    whole_peak = float(simulate(whole, roomy.cluster, on0).peak_memory_bytes[0])
    turns_peak = float(simulate(micro, roomy.cluster, np.zeros(micro.num_nodes, dtype=np.int64),
                                schedule=sched).peak_memory_bytes[0])
    assert turns_peak < whole_peak
    p = _wide_plan((turns_peak + whole_peak) / 2)
    single, _ = p.baselines
    assert single.fits and "4 micro-batches in turn; the whole batch fits no single device" in single.name
    assert single.name in " ".join(p.placed.text().split()) and p.placed.to_dict()["best_single_device"]["name"]


def test_the_even_split_does_not_depend_on_the_order_the_devices_are_listed_in():
    """One mixed cluster (fast, mid and slow devices; the link between fast and mid slow) listed in two orders:
    cutting the even split's parts onto the devices as listed sent the chain over the slow link in one listing
    only; cut onto the devices fastest first, both listings give the same step, above the lower bound."""
    g = graph([{"id": v, "kind": "forward", "compute_s": 1.0, "output_bytes": 4.0} for v in "abcdef"],
              [(a, b, 4) for a, b in zip("abcde", "bcdef", strict=True)])
    slow_link = (0.5, 0.0)

    def listed(speeds: list[float], fast: int, mid: int):
        return cluster(3, bw=100.0, speeds=speeds, links={(fast, mid): slow_link, (mid, fast): slow_link})

    one, other = listed([1.0, 0.4, 0.7], 0, 2), listed([0.7, 1.0, 0.4], 1, 0)
    for schedule in (None, Schedule("1f1b", 4)):
        a, b = (baselines(g, c, schedule)[1] for c in (one, other))
        assert a.step_time_s == b.step_time_s >= lower_bound(g, one, schedule).value_s
