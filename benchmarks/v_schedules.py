"""1F1B, ZB-H1, ZBV and DualPipeV side by side (issue 31): run on this CPU, and simulated on a GPU cluster.

    PYTHONPATH=$PWD/src nice -n 5 .venv/bin/python benchmarks/v_schedules.py [--steps 10] [--warmup 3]
        [--model sim_vs_real:tiny_gpt2 --batch 8 --microbatches 4] [--gpu-model llama-1b --gpu-batch 8
        --gpu-cluster 4xV100-16GB] [--skip-cpu] [--skip-gpu] [--json FILE]

**On this CPU** (`--model`, a custom model of benchmarks/sim_vs_real.py: nothing downloaded): its ops profiled
at the micro-batch size and the machine's overheads measured (`sim_vs_real`'s step 0 and 1), then two logical
CPUs:
- 1F1B and ZB-H1 (zero-bubble, one chunk per process): the `pipeline` placer's 2 stages under that schedule, run
  as `devplace run --plan` runs a pipelined plan;
- ZBV and DualPipeV: 4 stages in a V (process 0 holds stages 0 and 3, process 1 stages 1 and 2). The `pipeline`
  placer does not cut for a V (a placement cannot tell the turn's two stages apart), so the 4 stages are its 1F1B
  cut on the cluster with each device twice (`doubled`: 4 stages, one per device, the same op costs), simulated
  laid out as a V on the 2 devices (`sim.parallel.simulate_parallel` of a dp=1 plan, which judges memory on the
  real devices) and run from a pipeline export with stage_devices [0, 1, 1, 0] (`devplace run --pipeline`).
Each row: simulated step, measured wall median and fastest, CPU seconds of both processes (median), the first
step's loss against the one-process loss.

**Simulated on GPUs** (`--gpu-model` on `--gpu-cluster`, the README's demo): for each schedule, the `pipeline`
placer's pipeline (1F1B, ZB-H1) or, for the V schedules, its 2p-stage 1F1B cut on the doubled cluster laid out as
a V, simulated (devplace's default cost model); the step and the peak memory of the fullest device, M chosen by
the placer for 1F1B and ZB-H1 and `--gpu-v-microbatches` (default: the batch, M >= 2p for DualPipeV) for the V
cut.
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
    its default link: the 2p stages a V lays out on p devices, one per device, for the `pipeline` placer to cut.
    Each stage is cut to fit a whole device, and two share one in the V: the V's own simulation judges whether
    they fit together (at half the memory no cut of llama-1b b8 fits: its LM head's logits alone take 8.41 GB)."""
    from dataclasses import replace

    from devplace.hardware.cluster import Cluster

    copies = tuple(replace(d, name=f"{d.name}'") for d in cluster.devices)
    return Cluster(f"{cluster.name}-doubled", (*cluster.devices, *copies), cluster.link)


def v_cut(placed: Any, kind: str) -> tuple[np.ndarray, Any]:
    """(each op's stage along the data, the dp=1 `ParallelPlan` under V schedule `kind` on devices 0..p-1) of
    `placed`, a 1F1B pipeline of 2p stages on `doubled` devices (stage k on device k): a V lays stages 0..p-1 out
    on devices 0..p-1 and stages p..2p-1 back. A per-step op (the optimizer's, stage -1) goes with its device's
    stage."""
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
    return stage, ParallelPlan(dp=1, pp=p, microbatches=m, batch=batch, schedule=kind, devices=tuple(range(p)))


def v_export(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    """A pipeline export of 2p stages on `doubled` devices made a V export under `kind`: the same split points,
    stage s on device s (s < p) or 2p - 1 - s."""
    p = len(doc["stage_devices"]) // 2
    schedule = {**doc["schedule"], "kind": kind, "chunks": 2}
    return {**doc, "stage_devices": [*range(p), *reversed(range(p))], "schedule": schedule,
            "pipelined_step_time_s": None}


def v_pipeline(tasks: Any, prepared: Any, cluster: Any, m: int | None) -> Any:
    """The 2p-stage 1F1B pipeline (M = `m`, None: the placer's choice) on `doubled(cluster)` that the V schedules
    lay out on `cluster`."""
    settings = {"schedule": "1f1b", "chunks": 1} | ({"microbatches": m} if m is not None else {})
    return tasks.place_prepared(prepared, doubled(cluster), placer="pipeline", settings=settings)


def judged(tasks: Any, prepared: Any, cluster: Any, m: int | None, v_m: int | None) -> Any:
    """For each schedule of `KINDS`: (kind, the placed pipeline, its simulation). 1F1B and ZB-H1: the `pipeline`
    placer's on `cluster` (M = `m`, None: its choice), simulated by it; the V schedules: `v_pipeline`'s cut (M =
    `v_m`) laid out as a V, its `ParallelResult`."""
    from devplace.sim.parallel import simulate_parallel

    cut = None
    for kind in KINDS:
        t0 = time.perf_counter()
        if kind in V_KINDS:
            cut = cut or v_pipeline(tasks, prepared, cluster, v_m)
            stage, plan = v_cut(cut, kind)
            yield kind, cut, simulate_parallel(cut.graph, cluster, stage, plan)
        else:
            settings = {"schedule": kind, "chunks": 1} | ({"microbatches": m} if m is not None else {})
            placed = tasks.place_prepared(prepared, cluster, placer="pipeline", settings=settings)
            yield kind, placed, placed.result
        print(f"# {kind} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # its run too


def cpu_rows(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """The CPU runs (module docstring), one row per schedule."""
    from devplace import app
    from devplace.app.overheads import measure_overheads
    from devplace.hardware.cost import apply_overheads
    from devplace.runtime.run import local_cluster
    from sim_vs_real import _merged

    tasks = app.torch_tasks()
    m, name, batch = args.microbatches, args.model, args.batch
    overheads = measure_overheads(steps=args.steps, warmup=args.warmup, microbatches=m, repeats=args.repeats)
    print(f"# overheads: {overheads.overheads}", file=sys.stderr, flush=True)
    tables = [tasks.profile_model(name, folder / f"b{b}.costs.json", batch=b, repeats=args.repeats, threads=1,
                                  overheads=False)[1] for b in (batch, batch // m)]
    table = _merged(tables)
    table.overheads = overheads.overheads
    cpu = torch.device("cpu")
    cluster = apply_overheads(local_cluster([cpu, cpu], specs={cpu: table.device}), table)
    prepared = tasks.prepare_model(name, batch=batch, cluster=cluster, costs=table)
    rows = []
    for kind, placed, result in judged(tasks, prepared, cluster, m, m):
        t0 = time.perf_counter()
        plan_path = folder / f"{kind}.plan.json"
        tasks.save_placed_plan(placed, plan_path, model=name, batch=batch)
        if kind in V_KINDS:  # the 2p stages' export, laid out as a V
            path = folder / f"{kind}.pipeline.json"
            path.write_text(json.dumps(v_export(tasks.export_plan(plan_path, "pipeline")[0], kind)))
            ran = tasks.run_pipeline_export(path, steps=args.steps, warmup=args.warmup, trust_model=True)
        else:  # as `devplace run --plan` runs a pipelined plan
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
    """The simulated GPU pipelines (module docstring), one row per schedule."""
    from devplace import app
    from devplace.hardware.cluster import load_cluster

    tasks = app.torch_tasks()
    cluster = load_cluster(args.gpu_cluster)
    prepared = tasks.prepare_model(args.gpu_model, batch=args.gpu_batch, cluster=cluster)
    rows = []
    for kind, placed, result in judged(tasks, prepared, cluster, None, args.gpu_v_microbatches or args.gpu_batch):
        m = result.plan.microbatches if kind in V_KINDS else placed.placement.schedule.microbatches
        rows.append({"schedule": kind, "microbatches": m, "simulated_s": result.step_time_s,
                     "peak_bytes": float(np.max(result.as_sim_result().peak_memory_bytes if kind in V_KINDS
                                                else result.peak_memory_bytes)),
                     "feasible": bool(result.feasible)})
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
                    "batch)")
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
              f"{args.warmup}\n")
        print("| schedule | stages | simulated | wall median / fastest | CPU of 2 procs | loss / one-process | "
              "compute actions per process |")
        print("|---|---:|---:|---:|---:|---|---|")
        for r in cpu:
            acts = r["actions_per_step"] if any(r["actions_per_step"]) else "-"  # 1F1B runs no action list
            print(f"| {r['schedule']} M={r['microbatches']} | {r['stages']} | {r['simulated_s'] * 1e3:.1f} ms | "
                  f"{r['measured_s'] * 1e3:.1f} / {r['fastest_s'] * 1e3:.1f} ms | {r['cpu_s'] * 1e3:.1f} ms | "
                  f"{r['loss']:.6g} / {r['reference_loss']:.6g} | {acts} |")
    if gpu:
        print(f"\n{args.gpu_model} batch {args.gpu_batch} on {args.gpu_cluster}, simulated\n")
        print("| schedule | M | simulated step | fullest device | fits |")
        print("|---|---:|---:|---:|---|")
        for r in gpu:
            print(f"| {r['schedule']} | {r['microbatches']} | {r['simulated_s']:.4f} s | "
                  f"{r['peak_bytes'] / 1e9:.2f} GB | {r['feasible']} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"started": started.isoformat(), "load_before": load_before,
                                         "load_after": load_after, "cpu": cpu, "gpu": gpu}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
