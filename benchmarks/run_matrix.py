"""Issue 30's matrix: every tiny architecture of `devplace.zoo.tiny` placed by the default placer and by the
`pipeline` placer at 2, 3 and 4 stages under GPipe, 1F1B, interleaved 1F1B and zero bubble (torch's interleaved
zero bubble, 2 chunks per device by default), exported and run (CPU, gloo),
each run's loss and gradients compared with the unpipelined step's (tests/test_matrix.py is the cut CI runs).

    PYTHONPATH=src .venv/bin/python benchmarks/run_matrix.py [--arch llama bart ...]
        [--schedule gpipe 1f1b interleaved-1f1b zero-bubble] [--clusters 1xV100-16GB 2xK80 3xGPU-placeto
        4xV100-16GB] [--no-default] [--batch N]

Each cell is the command line's flow, the commands run as a user runs them (one `python -m devplace` process
each): `devplace place --model devplace.zoo.tiny:ARCH -c CLUSTER [--placer pipeline --schedule S] --save-plan
p.json`, then for a pipelined plan `devplace export p.json --format pipeline -o x.json` and the export run by
`devplace.runtime.run_pipeline` in this process (so that every parameter's gradient is compared, not only the
loss), for an unpipelined plan `devplace run --plan p.json --devices cpu,...` (its loss compared). The stage
count is the cluster's device count (times 2 chunks under interleaved-1f1b and zero-bubble; 1xV100-16GB, one
stage, is 4xV100-16GB's first device in a cluster file the script writes). BatchNorm's
pipelined step is compared with the step accumulated over the same micro-batches (micro-batching changes its
result, which the row says). Prints one row per cell and the count of cells that ran equal; never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from devplace.capture.custom import build_custom_model
from devplace.hardware.cluster import Cluster, load_cluster, save_cluster
from devplace.runtime.export import read_pipeline
from devplace.runtime.pipeline_run import accumulated_step, run_pipeline
from devplace.zoo.tiny import ARCHITECTURES

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
ONE = "1xV100-16GB"  # no preset has one device: the first device of 4xV100-16GB, written to a cluster file
CLUSTERS = (ONE, "2xK80", "3xGPU-placeto", "4xV100-16GB")  # 1, 2, 3 and 4 devices
DEFAULT_CLUSTER = "4xV100-16GB"


def _one_device(folder: Path) -> str:
    """A cluster file of one V100 (4xV100-16GB's first device), for the cells of one stage."""
    four = load_cluster(DEFAULT_CLUSTER)
    path = folder / f"{ONE}.json"
    save_cluster(Cluster(ONE, four.devices[:1], four.link), path)
    return str(path)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devplace", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "200"}, check=False)


def cell(arch: str, cluster: str, schedule: str | None, folder: Path, batch: int | None = None) -> dict[str, object]:
    """One cell: place, export, run, compare (at `batch`, None: the model's). A dict for the row (`ok` True when
    the run equals the reference)."""
    spec = f"devplace.zoo.tiny:{arch}"
    sized = ["--batch", str(batch)] if batch is not None else []
    plan, export = folder / "p.json", folder / "x.json"
    row: dict[str, object] = {"arch": arch, "cluster": cluster, "placer": "pipeline" if schedule else "default"}
    t0 = time.perf_counter()
    extra = ["--placer", "pipeline", "--schedule", schedule] if schedule else []
    where = _one_device(folder) if cluster == ONE else cluster
    done = _cli("place", "--model", spec, *sized, "-c", where, *extra, "--save-plan", str(plan), "--force", "--quiet")
    if done.returncode:
        return {**row, "ok": False, "what": f"place: {done.stderr.strip().splitlines()[-1:]}"}
    placed = json.loads(plan.read_text())
    sched = placed["placement"].get("schedule")
    model, inputs, _ = build_custom_model(spec, batch, seed=0)
    par = placed["placement"].get("parallel")
    if par is not None and (par["dp"] > 1 or max(par["zero"]) > 0 or "full" in par["recompute"]):
        # data-parallel replicas, ZeRO or recomputation: `devplace run --plan` runs it in dp * pp processes and
        # compares its loss with the one-process step's
        done = _cli("run", "--plan", str(plan), "--model", spec, *sized, "--steps", "1", "--warmup", "0", "--json")
        if done.returncode:
            return {**row, "ok": False, "what": f"run: {done.stderr.strip().splitlines()[-1:]}"}
        ran = json.loads(done.stdout)
        ok = abs(ran["losses"][0] - ran["reference_loss"]) <= 1e-5 * abs(ran["reference_loss"])
        return {**row, "ok": ok, "s": time.perf_counter() - t0, "what": f"parallel {par['dp']}x{par['pp']} on "
                f"{ran['processes']} processes: loss {ran['losses'][0]:.6g} vs {ran['reference_loss']:.6g}"}
    if sched is None:  # unpipelined: devplace run --plan
        devices = ",".join(["cpu"] * (max(placed["placement"]["assignment"].values()) + 1))
        done = _cli("run", "--plan", str(plan), "--model", spec, *sized, "--devices", devices, "--steps", "1",
                    "--warmup", "0", "--record", str(folder / "runs.jsonl"), "--json")
        if done.returncode:
            return {**row, "ok": False, "what": f"run: {done.stderr.strip().splitlines()[-1:]}"}
        loss = json.loads(done.stdout)["losses"][0]
        ref, _ = accumulated_step(model, inputs, 1)
        ok = abs(loss - ref) <= 1e-5 * abs(ref)
        return {**row, "ok": ok, "what": f"unpipelined on {devices.count('cpu')} device(s): loss {loss:.6g} vs "
                f"{ref:.6g}", "s": time.perf_counter() - t0}
    done = _cli("export", str(plan), "--format", "pipeline", "-o", str(export), "--force")
    if done.returncode:
        return {**row, "ok": False, "what": f"export: {done.stderr.strip().splitlines()[-1:]}"}
    ex = read_pipeline(export)
    ran = run_pipeline(model, inputs, ex, return_grads=True, optimizer="sgd")
    norms = any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in model.modules())
    ref, grads = accumulated_step(model, inputs, ex.schedule.microbatches if norms else 1)
    worst = max(float(((ran.grads[n] - g).abs() / (g.abs() + 1e-6)).max()) for n, g in grads.items())
    ok = abs(ran.losses[0] - ref) <= 1e-5 * abs(ref) and all(
        torch.allclose(ran.grads[n], g, rtol=1e-4, atol=1e-6) for n, g in grads.items())
    return {**row, "ok": ok, "s": time.perf_counter() - t0,
            "what": f"{ex.schedule.label}, {ex.num_stages} stages on {ex.processes} processes: loss "
                    f"{ran.losses[0]:.6g} vs {ref:.6g}{' (micro-batch-accumulated: BatchNorm)' if norms else ''}, "
                    f"largest gradient difference {worst:.1e} (relative)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    parser.add_argument("--schedule", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--clusters", nargs="*", default=list(CLUSTERS), help="none: the default placer's cells only")
    parser.add_argument("--no-default", action="store_true", help="skip the default placer's cells")
    parser.add_argument("--batch", type=int, help="the models' batch (default: theirs, 8; interleaved-1f1b on 3 "
                        "devices needs a multiple of 3)")
    args = parser.parse_args()
    cells = [(a, DEFAULT_CLUSTER, None) for a in args.arch if not args.no_default]
    cells += [(a, c, s) for a in args.arch for c in args.clusters for s in args.schedule]
    equal = 0
    with tempfile.TemporaryDirectory(prefix="devplace-matrix-") as tmp:
        for arch, cluster, schedule in cells:
            row = cell(arch, cluster, schedule, Path(tmp), args.batch)
            equal += bool(row["ok"])
            seconds = f"{row['s']:.0f} s" if "s" in row else ""
            print(f"{arch:8} {cluster:14} {row['placer']:8} {schedule or '-':17} "
                  f"{'equal' if row['ok'] else 'FAILED':6} {seconds:>6}  {row['what']}", flush=True)
    print(f"{equal} of {len(cells)} cells ran equal to their reference step")


if __name__ == "__main__":
    main()
