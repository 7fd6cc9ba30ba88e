"""1F1B, ZB-H1, ZBV and DualPipeV side by side (issue 31), each on its own cut: run on this CPU, and simulated on
a GPU cluster.

    PYTHONPATH=$PWD/src nice -n 5 .venv/bin/python benchmarks/v_schedules.py [--steps 10] [--warmup 3]
        [--model sim_vs_real:tiny_gpt2 --batch 8 --microbatches 4] [--gpu-model llama-1b --gpu-batch 8
        --gpu-cluster 4xV100-16GB --gpu-v-microbatches M] [--old-layout] [--skip-cpu] [--skip-gpu] [--json FILE]

The cuts: 1F1B and ZB-H1 (zero bubble, one chunk per device) on the `pipeline` placer's pipeline for that
schedule (one stage per device); ZBV and DualPipeV on the V cut the placer makes for that schedule, as the
parallel search makes it for dp = 1 (`pipeline_plan(..., schedule="zbv"|"dualpipev")` on one micro-batch captured
at its own size: 2p stages, stage k on device k and stage 2p - 1 - k back on it), simulated as a dp=1 parallel
plan (`sim.parallel.simulate_parallel`, which judges memory on the real devices). Where the placer finds no V cut
(none fits the devices, or none torch's pipelining runs), the row says why. `--old-layout` adds, for the GPU
cluster, the layout this benchmark used before the placer cut for a V: the placer's 2p-stage 1F1B cut on the
cluster with each device twice (`doubled`) laid out as a V.

**On this CPU** (`--model`, a custom model of benchmarks/sim_vs_real.py: nothing downloaded): its ops profiled
at the micro-batch size and the machine's overheads measured (`sim_vs_real`'s step 0 and 1), then two logical
CPUs, every schedule at M = `--microbatches`: 1F1B and ZB-H1 run as `devplace run --plan` runs a pipelined plan;
ZBV and DualPipeV from a pipeline export of the V's stages (cut where they begin, as a saved V plan's export
cuts them; process 0 holds stages 0 and 3, process 1 stages 1 and 2; `devplace run --pipeline`).
Each row: simulated step, measured wall median and fastest, CPU seconds of both processes (median), the ratios
of the simulated step and the CPU time to 1F1B's, the first step's loss against the one-process loss.

**Simulated on GPUs** (`--gpu-model` on `--gpu-cluster`, by default the README's demo): the step, its ratio to
1F1B's and the peak memory of the fullest device; M chosen by the placer for 1F1B and ZB-H1, and for the V cut
`--gpu-v-microbatches` (default: 1F1B's M; DualPipeV needs M >= 2p).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = str(Path(__file__).resolve().parent)
if BENCH not in sys.path:  # the custom models of sim_vs_real must import here and in the stage processes
    sys.path.insert(0, BENCH)

import numpy as np  # noqa: E402
import torch  # noqa: E402

V_KINDS = ("zbv", "dualpipev")
KINDS = ("1f1b", "zero-bubble", *V_KINDS)


def doubled(cluster: Any) -> Any:
    """`cluster` with each device twice (the copies after the originals, named with a prime), every pair joined by
    its default link: the 2p stages of the old V layout (`--old-layout`), one per device, for the `pipeline`
    placer's 1F1B cut. Each stage is cut to fit a whole device, and two share one in the V: the V's own simulation
    judges whether they fit together."""
    from dataclasses import replace

    from devplace.hardware.cluster import Cluster

    copies = tuple(replace(d, name=f"{d.name}'") for d in cluster.devices)
    return Cluster(f"{cluster.name}-doubled", (*cluster.devices, *copies), cluster.link)


def laid_out(placed: Any, kind: str) -> tuple[Any, np.ndarray, Any]:
    """(the graph, each op's stage along the data, the dp=1 `ParallelPlan` under V schedule `kind` on devices
    0..p-1) of `placed`, a 1F1B pipeline of 2p stages on `doubled` devices (stage k on device k) laid out as a V:
    stages 0..p-1 on devices 0..p-1 and stages p..2p-1 back. A per-step op (the optimizer's, stage -1) goes with
    its device's stage."""
    from devplace.graph.batch import graph_batch, graph_microbatches
    from devplace.graph.parallel import ParallelPlan

    sched = placed.placement.schedule
    m = graph_microbatches(placed.graph) or sched.microbatches
    batch = (graph_batch(placed.graph) or m) * (m if graph_microbatches(placed.graph) else 1)
    devices = np.asarray([placed.placement.assignment[i] for i in placed.graph.ids], dtype=np.int64)
    order = list(sched.device_order or range(int(devices.max()) + 1))
    position = np.asarray([order.index(int(d)) for d in devices], dtype=np.int64)
    stage = np.where(placed.result.stage >= 0, placed.result.stage, position).astype(np.int64)
    p = len(order) // 2
    return placed.graph, stage, ParallelPlan(dp=1, pp=p, microbatches=m, batch=batch, schedule=kind,
                                             chunks=2, devices=tuple(range(p)))


def v_cut(prepared: Any, cluster: Any, kind: str, m: int) -> tuple[Any, np.ndarray, Any]:
    """(the graph of one of `m` micro-batches, each op's stage, the dp=1 `ParallelPlan` under V schedule `kind`) of
    the V cut the `pipeline` placer makes, as the parallel search makes it for dp = 1 (`pipeline_plan` with that
    schedule on one micro-batch captured at its own size: 2p stages, stage k on position k and 2p - 1 - k on the
    way back). NoFitError where no V split fits the devices, PlacerError where none runs."""
    from devplace.capture.custom import microbatch_graphs
    from devplace.graph.parallel import ParallelPlan
    from devplace.placers.parallel import as_microbatch
    from devplace.placers.pipeline import pipeline_plan

    graphs = microbatch_graphs(prepared)
    assert graphs is not None, "a model captured here has its micro-batch graphs"
    one = as_microbatch(graphs(m)[0], m)
    cut = pipeline_plan(one, cluster, one.topo_order, schedule=kind, microbatches=m)
    p = cluster.num_devices
    devices = tuple(cut.schedule.device_order or range(p))
    plan = ParallelPlan(dp=1, pp=p, microbatches=m, batch=prepared_batch(prepared), schedule=kind, chunks=2,
                        devices=devices)
    return one, cut.stage, plan


def prepared_batch(prepared: Any) -> int:
    """The whole batch a prepared model was captured at."""
    from devplace.graph.batch import graph_batch

    batch = graph_batch(prepared.full)
    assert batch is not None, "a model captured here records its batch"
    return batch


def v_export(base: dict[str, Any], graph: Any, stage: np.ndarray, plan: Any) -> dict[str, Any]:
    """A pipeline export of the V `plan` whose stages (`stage` per op of `graph`) begin where torch's pipelining
    cuts (`pipeline_split` of the stages, as `runtime.parallel_export.recorded_split` cuts a saved V plan): stage
    s on device s (s < p) or 2p - 1 - s; the model source and precision from `base`, another export of the same
    model."""
    from devplace.graph.placement import Placement
    from devplace.graph.schedule import Schedule
    from devplace.runtime.export import pipeline_split

    split = pipeline_split(graph, Placement.from_array(graph, stage), schedule=Schedule("1f1b", plan.microbatches))
    if len(split.devices) != 2 * plan.pp:
        raise RuntimeError(f"the V's stages cut into {len(split.devices)} pipeline stages, not {2 * plan.pp}")
    doc = split.to_dict()
    schedule = {**doc["schedule"], "kind": plan.schedule, "chunks": 2}
    kept = {k: base[k] for k in ("source", "source_params", "precision") if k in base}
    return {**doc, **kept, "stage_devices": [*range(plan.pp), *reversed(range(plan.pp))], "schedule": schedule}


def judged(tasks: Any, prepared: Any, cluster: Any, m: int | None, v_m: int | None, old_layout: bool) -> Any:
    """For each schedule of `KINDS` (and, with `old_layout`, each V schedule on the old layout, kind "<kind> on
    the 1F1B cut"): (kind, what was placed, its simulation or the error that no cut was found). 1F1B and ZB-H1:
    the `pipeline` placer's pipeline on `cluster` (M = `m`, None: its choice), simulated by it; the V schedules:
    `v_cut` (M = `v_m`, None: the M 1F1B got), `simulate_parallel`'s `ParallelResult`; the old layout: the
    placer's 2p-stage 1F1B cut on `doubled(cluster)` laid out as a V."""
    from devplace.errors import DevplaceError
    from devplace.sim.parallel import simulate_parallel

    first_m = m
    for kind in KINDS:
        t0 = time.perf_counter()
        if kind in V_KINDS:
            assert first_m is not None
            try:
                graph, stage, plan = v_cut(prepared, cluster, kind, v_m or first_m)
            except DevplaceError as exc:  # no V cut fits or runs: the row says why
                yield kind, None, exc
            else:
                yield kind, (graph, stage, plan), simulate_parallel(graph, cluster, stage, plan)
        else:
            settings = {"schedule": kind, "chunks": 1} | ({"microbatches": m} if m is not None else {})
            placed = tasks.place_prepared(prepared, cluster, placer="pipeline", settings=settings)
            first_m = first_m or placed.placement.schedule.microbatches
            yield kind, placed, placed.result
        print(f"# {kind} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # its run too
    if old_layout:
        t0 = time.perf_counter()
        settings = {"schedule": "1f1b", "chunks": 1, "microbatches": v_m or first_m}
        cut = tasks.place_prepared(prepared, doubled(cluster), placer="pipeline", settings=settings)
        for kind in V_KINDS:
            graph, stage, plan = laid_out(cut, kind)
            yield f"{kind} on the 1F1B cut", (graph, stage, plan), simulate_parallel(graph, cluster, stage, plan)
        print(f"# old layout done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def cpu_rows(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """The CPU runs (module docstring), one row per schedule."""
    from devplace import app
    from devplace.app.overheads import measure_overheads
    from devplace.hardware.cost import apply_overheads
    from devplace.runtime.in_step import merge_tables
    from devplace.runtime.run import local_cluster

    tasks = app.torch_tasks()
    m, name, batch = args.microbatches, args.model, args.batch
    overheads = measure_overheads(steps=args.steps, warmup=args.warmup, microbatches=m, repeats=args.repeats)
    print(f"# overheads: {overheads.overheads}", file=sys.stderr, flush=True)
    tables = [tasks.profile_model(name, folder / f"b{b}.costs.json", batch=b, repeats=args.repeats, threads=1,
                                  overheads=False)[1] for b in (batch, batch // m)]
    table = merge_tables(tables)
    table.overheads = overheads.overheads
    cpu = torch.device("cpu")
    cluster = apply_overheads(local_cluster([cpu, cpu], specs={cpu: table.device}), table)
    prepared = tasks.prepare_model(name, batch=batch, cluster=cluster, costs=table)
    rows = []
    base: dict[str, Any] = {}
    for kind, placed, result in judged(tasks, prepared, cluster, m, m, False):
        t0 = time.perf_counter()
        if isinstance(result, Exception):
            rows.append({"schedule": kind, "microbatches": m, "error": str(result)})
            continue
        if kind in V_KINDS:  # the V cut's 2p stages, exported as torch's pipelining cuts them
            path = folder / f"{kind}.pipeline.json"
            path.write_text(json.dumps(v_export(base, *placed)))
            ran = tasks.run_pipeline_export(path, steps=args.steps, warmup=args.warmup, trust_model=True)
        else:  # as `devplace run --plan` runs a pipelined plan
            plan_path = folder / f"{kind}.plan.json"
            tasks.save_placed_plan(placed, plan_path, model=name, batch=batch)
            base = base or tasks.export_plan(plan_path, "pipeline")[0]
            p, module, inputs = tasks.plan_for_run(plan_file=plan_path, trust_model=True)
            ran = tasks.run_plan_pipelined(p, module, inputs, steps=args.steps, warmup=args.warmup)
        timed = ran.timed_s
        rows.append({"schedule": kind, "microbatches": m, "stages": ran.export.num_stages,
                     "split_points": list(ran.export.split_points), "simulated_s": result.step_time_s,
                     "measured_s": statistics.median(timed), "fastest_s": min(timed), "steps_s": timed,
                     "cpu_s": statistics.median(ran.run.cpu_times_s[args.warmup:]), "loss": ran.run.losses[0],
                     "reference_loss": ran.reference_loss, "actions_per_step": [len(a) for a in ran.run.actions],
                     "wall_s": time.perf_counter() - t0})
        print(f"# cpu {kind} ran in {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return rows


def gpu_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The simulated GPU pipelines (module docstring), one row per schedule (and per V on the old layout)."""
    from devplace import app
    from devplace.hardware.cluster import load_cluster

    tasks = app.torch_tasks()
    cluster = load_cluster(args.gpu_cluster)
    prepared = tasks.prepare_model(args.gpu_model, batch=args.gpu_batch, cluster=cluster)
    rows = []
    for kind, placed, result in judged(tasks, prepared, cluster, None, args.gpu_v_microbatches, args.old_layout):
        if isinstance(result, Exception):
            rows.append({"schedule": kind, "error": str(result)})
            continue
        one_chunk = kind in ("1f1b", "zero-bubble")
        m = placed.placement.schedule.microbatches if one_chunk else result.plan.microbatches
        peak = result.peak_memory_bytes if one_chunk else result.as_sim_result().peak_memory_bytes
        rows.append({"schedule": kind, "microbatches": m, "simulated_s": result.step_time_s,
                     "peak_bytes": float(np.max(peak)), "feasible": bool(result.feasible)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sim_vs_real:tiny_gpt2", help="custom model run on this CPU")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4, help="M of every CPU pipeline (DualPipeV needs >= 4)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per op when profiling")
    ap.add_argument("--gpu-model", default="llama-1b")
    ap.add_argument("--gpu-batch", type=int, default=8)
    ap.add_argument("--gpu-cluster", default="4xV100-16GB")
    ap.add_argument("--gpu-v-microbatches", type=int, default=None, help="M of the V schedules' cut (default: the "
                    "M the pipeline placer chose for 1F1B)")
    ap.add_argument("--old-layout", action="store_true", help="also the V schedules on the placer's 2p-stage 1F1B "
                    "cut laid out as a V (the layout of this benchmark before the placer cut for a V)")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--skip-gpu", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="v-schedules-") as tmp:
        cpu = [] if args.skip_cpu else cpu_rows(args, Path(tmp))
    gpu = [] if args.skip_gpu else gpu_rows(args)
    load_after = os.getloadavg()
    print(f"# {started:%Y-%m-%d %H:%M %Z}, machine {platform.node()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}; load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    if cpu:
        print(f"\n{args.model} batch {args.batch}, 2 processes (gloo, 1 thread each), {args.steps} timed steps after "
              f"{args.warmup}; ratios to 1F1B's row\n")
        print("| schedule | stages | simulated | wall median / fastest | CPU of 2 procs | simulated, CPU / 1F1B | "
              "loss / one-process | compute actions per process |")
        print("|---|---:|---:|---:|---:|---:|---|---|")
        first = cpu[0]
        for r in cpu:
            if "error" in r:
                print(f"| {r['schedule']} M={r['microbatches']} | no cut: {r['error']} |")
                continue
            acts = r["actions_per_step"] if any(r["actions_per_step"]) else "-"  # 1F1B runs no action list
            print(f"| {r['schedule']} M={r['microbatches']} | {r['stages']} | {r['simulated_s'] * 1e3:.1f} ms | "
                  f"{r['measured_s'] * 1e3:.1f} / {r['fastest_s'] * 1e3:.1f} ms | {r['cpu_s'] * 1e3:.1f} ms | "
                  f"{r['simulated_s'] / first['simulated_s']:.2f}, {r['cpu_s'] / first['cpu_s']:.2f} | "
                  f"{r['loss']:.6g} / {r['reference_loss']:.6g} | {acts} |")
    if gpu:
        print(f"\n{args.gpu_model} batch {args.gpu_batch} on {args.gpu_cluster}, simulated\n")
        print("| schedule | M | simulated step | / 1F1B | fullest device | fits |")
        print("|---|---:|---:|---:|---:|---|")
        for r in gpu:
            if "error" in r:
                print(f"| {r['schedule']} | no cut: {r['error']} |")
                continue
            print(f"| {r['schedule']} | {r['microbatches']} | {r['simulated_s']:.4f} s | "
                  f"{r['simulated_s'] / gpu[0]['simulated_s']:.3f} | {r['peak_bytes'] / 1e9:.2f} GB | "
                  f"{r['feasible']} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"started": started.isoformat(), "load_before": load_before,
                                         "load_after": load_after, "cpu": cpu, "gpu": gpu}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
