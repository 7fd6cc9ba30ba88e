"""Measuring what a real training step costs beyond its ops' profiled times on this machine (`Overheads`):
the per-op overhead, gloo's per-transfer latency and the pipelining runtime's cost per action. `devplace
profile` stores them in its cost table; `place --costs` / `run --costs` and the simulator then charge them.

Each is measured on a probe model of its own (`probe`: four small transformer blocks written out in plain torch,
whose ops are dominated by the costs measured here), never on the model being profiled, so the
measured/simulated ratios that benchmarks/sim_vs_real.py reports for other models are not fitted to them:

1. `op_s`: the probe's profiled step placed on one CPU device (placer `single`), run as `devplace run --plan`
   runs it (1 thread); (CPU seconds of the median step - its simulated step without the overhead) / its ops
   that are not views. CPU time, not wall: other processes sharing the cores do not inflate it.
2. `transfer_latency_s`: half the median round trip of a one-element tensor between two gloo processes.
3. `action_s`: the probe placed by the `pipeline` placer on two CPU processes (1f1b by default, the schedule
   that placer picks, `microbatches`; torch's 1F1B costs 15-25% more per action than its GPipe), with the
   two figures above; run as `devplace run --plan` runs a pipelined plan; (CPU seconds of both processes per
   median step - the simulated busy seconds of the two devices) / the actions of a step (the busy seconds grow
   by exactly that many action_s). CPU time again: under load, a wall-clock fit charged the waiting for a core
   to the runtime (2.4 and 12 ms per action in two runs a minute apart at load 9 on 2 cores).

With `in_step`, the probe's ops are costed as `devplace profile --in-step` costs a model's (each op timed inside
real steps of the probe, `runtime.in_step`), so `op_s` is then what a step costs beyond its ops timed that way,
and a table of in-step times carries overheads measured the same way.

Reached through `app.with_torch.profile_model` (it needs torch and the runtime).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from devplace.capture.custom import build_named_model, capture_named_model
from devplace.capture.profile import local_cpu_device, profile_graph
from devplace.files import json_text
from devplace.hardware.cost import CostTable, Overheads, apply_overheads, op_class
from devplace.runtime.export import pipeline_split
from devplace.runtime.in_step import merge_tables, profile_in_step
from devplace.runtime.plan import named_source, plan_from_placed, rebuild_zoo_model
from devplace.runtime.run import local_cluster, measure_plan
from devplace.sim import simulate

__all__ = ["PROBE", "OverheadRun", "gloo_round_trip", "measure_overheads", "probe"]

PROBE = "devplace.app.overheads:probe"  # the probe model, as a custom model name (devplace's own code)
PROBE_BATCH = 8


class _Block(nn.Module):
    """A pre-norm transformer block written out (attention by matmul and softmax, GELU MLP, residuals): the mix
    of module calls, small matrix products, norms and elementwise ops that model code is made of."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Probe(nn.Module):
    """`layers` `_Block`s of `width` over sequences of 8, mean-pooled, then cross-entropy over 8 classes."""

    def __init__(self, layers: int = 4, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block(width, heads) for _ in range(layers)])
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.blocks(x).mean(dim=1)), labels)


def probe(batch: int = PROBE_BATCH) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The probe model and its inputs (a custom-model factory: `PROBE`)."""
    return _Probe(), (torch.randn(batch, 8, 32), torch.randint(0, 8, (batch,)))


@dataclass(frozen=True)
class OverheadRun:
    """What `measure_overheads` measured: the overheads and the figures they came from."""

    overheads: Overheads
    one_device_cpu_s: float  # median CPU seconds of the probe's one-device step
    one_device_simulated_s: float  # its simulated step without the per-op overhead
    ops: int  # the probe step's ops that are not views
    round_trip_s: float  # gloo round trip of one element
    pipeline_measured_s: float  # median wall seconds of the probe's pipelined step
    pipeline_cpu_s: float  # median CPU seconds of its two processes together per step
    pipeline_simulated_s: float  # its simulated step with the measured overheads
    actions: int  # the actions of the pipelined step (both devices)
    wall_s: float  # how long measuring took
    in_step: bool = False  # the probe's ops were timed inside real steps (`runtime.in_step`), not alone

    def to_dict(self) -> dict[str, Any]:
        """The figures, for the cost table's meta."""
        return {"one_device_cpu_s": self.one_device_cpu_s, "one_device_simulated_s": self.one_device_simulated_s,
                "ops": self.ops, "round_trip_s": self.round_trip_s, "pipeline_measured_s": self.pipeline_measured_s,
                "pipeline_cpu_s": self.pipeline_cpu_s, "pipeline_simulated_s": self.pipeline_simulated_s,
                "actions": self.actions, "wall_s": self.wall_s, "probe": PROBE, "in_step": self.in_step}


def gloo_round_trip(sizes: list[int], repeats: int = 50) -> dict[str, float]:
    """Median seconds of a gloo send + recv round trip between two CPU processes (one thread each) for tensors
    of `sizes` float32 elements, by size."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="devplace-gloo-") as folder:
        mp.start_processes(_gloo_worker, args=(folder, sizes, repeats), nprocs=2, join=True,
                           start_method="forkserver")
        return {int(k): v for k, v in json.loads((Path(folder) / "gloo.json").read_text()).items()}


def _gloo_worker(rank: int, folder: str, sizes: list[int], repeats: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    out: dict[str, float] = {}
    try:
        for n in sizes:
            x = torch.zeros(n)
            times = []
            for i in range(repeats + 5):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)
                else:
                    dist.recv(x, 0)
                    dist.send(x, 0)
                if i >= 5:  # the first round trips set the connection up
                    times.append(time.perf_counter() - t0)
            out[str(n)] = statistics.median(times)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(folder) / "gloo.json").write_text(json_text(out))  # a temporary file between processes


def _probe_table(microbatches: int, repeats: int, in_step: bool) -> CostTable:
    """The probe's ops profiled on this CPU at the whole batch and at one micro-batch, in one table; `in_step`:
    also timed inside real steps at both sizes, those times over the isolated ones."""
    tables = []
    for b in dict.fromkeys((PROBE_BATCH, PROBE_BATCH // microbatches)):
        graph = capture_named_model(PROBE, batch=b)
        tables.append(profile_graph(graph, "cpu", repeats=repeats))
        if in_step:
            module, inputs, loss_fn = build_named_model(PROBE, b)
            tables.append(profile_in_step(graph, module, inputs, tables[0].device or local_cpu_device(),
                                          loss_fn=loss_fn))
    return merge_tables(tables)


def measure_overheads(*, steps: int = 10, warmup: int = 3, microbatches: int = 4, repeats: int = 10,
                      in_step: bool = False, schedule: str = "1f1b") -> OverheadRun:
    """Measure the `Overheads` of this machine's CPU runtime on the probe model (the module docstring says how;
    `in_step`: beyond its ops timed inside real steps; `schedule`: the pipelined probe's). Steps run with 1 thread
    (as a pipelined run's stages do); the caller's thread count is restored."""
    from devplace.app.with_torch import place_prepared, prepare_model, run_plan_pipelined

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = _probe_table(microbatches, repeats, in_step)
        cpu = torch.device("cpu")
        # 1. per op: one device
        one = local_cluster([cpu], specs={cpu: table.device})
        placed = place_prepared(prepare_model(PROBE, batch=PROBE_BATCH, cluster=one, costs=table), one,
                                placer="single")
        p = plan_from_placed(placed, settings={"optimizer": "adam"},
                             source=named_source(PROBE, PROBE_BATCH, None, 0))
        module, inputs = rebuild_zoo_model(p, trust_model=True)
        _, run, _ = measure_plan(p, module, inputs, [cpu], steps=steps, warmup=warmup)
        cpu_s = statistics.median(run.cpu_times_s)
        sim_s = p.runtime_result.step_time_s
        ops = sum(1 for v in range(p.graph.num_nodes) if op_class(p.graph.op[v], p.graph.kind[v]) != "view")
        op_s = max(0.0, (cpu_s - sim_s) / ops)
        # 2. per transfer
        trip = gloo_round_trip([1])[1]
        # 3. per action: a pipeline of two processes, costed with the two figures above
        table.overheads = Overheads(op_s=op_s, transfer_latency_s=trip / 2)
        two = apply_overheads(local_cluster([cpu, cpu], specs={cpu: table.device}), table)
        placed2 = place_prepared(prepare_model(PROBE, batch=PROBE_BATCH, cluster=two, costs=table), two,
                                 placer="pipeline", settings={"schedule": schedule, "microbatches": microbatches})
        p2 = plan_from_placed(placed2, settings={"optimizer": "adam"},
                              source=named_source(PROBE, PROBE_BATCH, None, 0))
        module2, inputs2 = rebuild_zoo_model(p2, trust_model=True)
        ran = run_plan_pipelined(p2, module2, inputs2, steps=steps, warmup=warmup)
        pipe_cpu = statistics.median(ran.run.cpu_times_s[warmup:])
        split = pipeline_split(p2.graph, p2.placement, two, schedule=p2.placement.schedule)

        def simulated(a: float) -> Any:
            with_a = replace(table, overheads=replace(table.overheads, action_s=a))
            return simulate(p2.graph, apply_overheads(two, with_a), split.placement, schedule=split.schedule)

        busy0 = float(simulated(0.0).device_busy_s.sum())
        actions = round(float(simulated(1.0).device_busy_s.sum()) - busy0)  # each action adds its action_s
        action_s = max(0.0, (pipe_cpu - busy0) / actions) if actions else 0.0
    finally:
        torch.set_num_threads(threads)
    o = Overheads(op_s=op_s, action_s=action_s, transfer_latency_s=trip / 2)
    return OverheadRun(o, cpu_s, sim_s, ops, trip, statistics.median(ran.timed_s), pipe_cpu,
                       simulated(action_s).step_time_s, actions, time.perf_counter() - started, in_step)
