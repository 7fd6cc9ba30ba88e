"""Check the simulator against real training steps on this machine's GPU (docs/runtime.md, docs/performance.md).

One command, meant to finish in well under 8 minutes on a machine with an NVIDIA GPU:

1. capture a zoo model's training step and **profile** every distinct op on the GPU (a cost table);
2. cost the graph with that table and compare, on **one GPU**, the simulated step time with the measured one
   (the model placed on cuda:0 by devplace.runtime, and the plain eager module for reference);
3. place the model on **CPU + GPU** (`contiguous`: a two-stage split, the CPU taking the share its measured
   speed can carry) and compare simulated and measured step time there too.

It prints the relative errors ((simulated - measured) / measured) and writes everything as JSON (`--output`).

`--dry-run` runs the same code path on the CPU only, at tiny size (a small CNN instead of the zoo model, at
most 40 op signatures profiled; "GPU" is the CPU and "CPU + GPU" is two logical devices on the CPU): it needs
no CUDA and takes seconds, and the test suite runs it. Its figures say nothing about GPUs.

    .venv/bin/python benchmarks/validate_on_gpu.py                 # resnet50, batch 32, on cuda:0
    .venv/bin/python benchmarks/validate_on_gpu.py --model gpt2 --batch 4 --seq-len 256
    .venv/bin/python benchmarks/validate_on_gpu.py --dry-run --output /tmp/validate.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from devplace.capture.pipeline import prepare
from devplace.capture.profile import calibrate, local_cpu_device, profile_graph
from devplace.capture.torch_capture import capture
from devplace.errors import DevplaceError
from devplace.runtime.plan import plan_from_prepared
from devplace.runtime.run import local_cluster, measure_plan, run_steps


class _TinyNet(torch.nn.Module):
    """The --dry-run model: two convolutions with batch norm, a classifier; returns its loss (zoo contract)."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 5)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.body(images)), labels)


def _rel(sim: float, meas: float) -> float:
    return (sim - meas) / meas if meas > 0 else float("nan")


def _build(args: argparse.Namespace) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], str]:
    if args.dry_run:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return _TinyNet(), (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))), "tiny-cnn-b4"
    from devplace.zoo.models import build_model

    module, inputs, _ = build_model(args.model, args.batch, args.seq_len, seed=0)
    return module, tuple(inputs), f"{args.model}-b{args.batch}"


def _to(inputs: tuple[torch.Tensor, ...], dev: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(dev) for x in inputs)


def _measured_vs_simulated(p: Any, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], devices: list[str],
                           steps: int, warmup: int) -> dict[str, Any]:
    placed, run, rec = measure_plan(p, module, inputs, devices, steps=steps, warmup=warmup)
    sim = p.runtime_result  # the placement as the runtime runs it (backward ops with their forward op)
    return {"devices": devices, "placer": p.settings.get("placer"), "simulated_step_s": sim.step_time_s,
            "planned_step_s": p.result.step_time_s,
            "measured_step_s": run.step_time_s, "measured_steps_s": run.step_times_s, "timer": run.timer,
            "rel_error": _rel(sim.step_time_s, run.step_time_s), "granularity": placed.granularity,
            "crossings_per_forward": placed.crossings,
            "ops_per_device": [int((sim.device == d).sum()) for d in range(p.cluster.num_devices)],
            "simulated_peak_memory_bytes": [float(x) for x in sim.peak_memory_bytes],
            "measured_peak_memory_bytes": run.peak_memory_bytes, "record": rec}


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three checks (module docstring) and return their figures."""
    t_start = time.perf_counter()
    if args.dry_run:
        gpu, cpu = torch.device("cpu"), torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise DevplaceError("no CUDA GPU is visible to torch; run with --dry-run to check the script on the CPU")
        gpu, cpu = torch.device("cuda", args.gpu), torch.device("cpu")
    module, inputs, label = _build(args)
    graph = capture(module, inputs, name=label)

    # 1. profile every distinct op on the "GPU"
    t0 = time.perf_counter()
    table = profile_graph(graph, gpu, warmup=args.op_warmup, repeats=args.op_repeats, max_ops=args.max_ops)
    profile_s = time.perf_counter() - t0
    spec = table.device
    assert spec is not None
    cal = calibrate(graph, table)
    prepared = prepare(graph, device=spec, costs=table, max_nodes=args.max_nodes)

    # 2. one GPU: simulated vs measured (placed by the runtime, and the eager module for reference)
    single_cluster = local_cluster([gpu], specs={gpu: spec})
    single_plan = plan_from_prepared(prepared, single_cluster, placer="single")
    single_plan.build["optimizer"] = "adam"
    eager_module = copy.deepcopy(module).to(gpu)
    eager = run_steps(eager_module, _to(inputs, gpu), steps=args.steps, warmup=args.warmup, devices=[gpu])
    del eager_module
    single = _measured_vs_simulated(single_plan, copy.deepcopy(module), inputs, [str(gpu)], args.steps, args.warmup)
    single["eager_step_s"] = eager.step_time_s
    single["rel_error_vs_eager"] = _rel(single_plan.runtime_result.step_time_s, eager.step_time_s)

    # 3. CPU + GPU: a two-stage split by the contiguous placer
    cpu_spec = spec if args.dry_run else local_cpu_device()
    hybrid_cluster = local_cluster([gpu, cpu], specs={gpu: spec, cpu: cpu_spec})
    hybrid_plan = plan_from_prepared(prepared, hybrid_cluster, placer=args.hybrid_placer)
    hybrid_plan.build["optimizer"] = "adam"
    hybrid = _measured_vs_simulated(hybrid_plan, copy.deepcopy(module), inputs, [str(gpu), str(cpu)], args.steps,
                                    args.warmup)

    return {
        "format": "devplace.validate/1", "dry_run": bool(args.dry_run), "model": label,
        "device": spec.kind, "torch": torch.__version__, "graph_ops": graph.num_nodes,
        "groups": prepared.graph.num_nodes,
        "profile": {"signatures_timed": len(table), "skipped": len(table.skipped), "seconds": profile_s,
                    "analytic_over_profiled": cal["all"]["ratio"],
                    "median_abs_rel_error_analytic": cal["all"]["median_abs_rel_error"]},
        "single_device": single, "cpu_plus_gpu": hybrid,
        "errors": {"single_device_rel_error": single["rel_error"], "single_vs_eager_rel_error":
                   single["rel_error_vs_eager"], "cpu_plus_gpu_rel_error": hybrid["rel_error"]},
        "wall_s": time.perf_counter() - t_start,
    }


def _print(res: dict[str, Any]) -> None:
    def ms(x: float) -> str:
        return f"{x * 1e3:9.3f} ms"

    dry = " (DRY RUN: CPU only, figures say nothing about GPUs)" if res["dry_run"] else ""
    print(f"{res['model']} on {res['device']}{dry}")
    pr = res["profile"]
    print(f"  profiled {pr['signatures_timed']} op signatures ({pr['skipped']} skipped) in {pr['seconds']:.1f} s; "
          f"analytic / profiled op time = {pr['analytic_over_profiled']:.2f}")
    s, h = res["single_device"], res["cpu_plus_gpu"]
    print(f"  one device   : simulated {ms(s['simulated_step_s'])}, measured placed {ms(s['measured_step_s'])}, "
          f"eager {ms(s['eager_step_s'])}; error {s['rel_error']:+.1%} (vs eager {s['rel_error_vs_eager']:+.1%})")
    print(f"  CPU + GPU    : simulated {ms(h['simulated_step_s'])}, measured {ms(h['measured_step_s'])}; error "
          f"{h['rel_error']:+.1%}; ops per device {h['ops_per_device']}, {h['crossings_per_forward']} crossings")
    print(f"  total {res['wall_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, validate, print, write JSON; exit status 2 on a user error."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU only, tiny model: check the script without CUDA")
    ap.add_argument("--model", default="resnet50", help="zoo model (see `devplace zoo list`)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--gpu", type=int, default=0, help="CUDA device index")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps per measurement")
    ap.add_argument("--warmup", type=int, default=2, help="untimed training steps first")
    ap.add_argument("--op-repeats", type=int, default=10, help="timed runs per op signature when profiling")
    ap.add_argument("--op-warmup", type=int, default=3)
    ap.add_argument("--max-ops", type=int, default=None, help="profile at most this many op signatures")
    ap.add_argument("--max-nodes", type=int, default=None, help="coarsen to at most this many groups")
    ap.add_argument("--hybrid-placer", default="contiguous", help="placer for the CPU + GPU placement")
    ap.add_argument("--output", type=Path, default=Path("validate_on_gpu.json"))
    args = ap.parse_args(argv)
    if args.dry_run:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.op_repeats, args.op_warmup = min(args.op_repeats, 2), min(args.op_warmup, 1)
        args.max_ops = min(args.max_ops or 40, 40)
    try:
        res = validate(args)
    except DevplaceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print(res)
    args.output.write_text(json.dumps(res, indent=1, default=float) + "\n", encoding="utf-8")
    print(f"  wrote {args.output}; median |error| {statistics.median(abs(v) for v in res['errors'].values()):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
