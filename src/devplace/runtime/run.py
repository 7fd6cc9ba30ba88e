"""Run real training steps of a placed module, time them, and compare with the simulation (docs/runtime.md).

Timing: a few untimed warm-up steps, then `steps` timed ones. Where the placement uses a CUDA device, each
step is timed with CUDA events on the first CUDA device, every other CUDA device in use being synchronised
before the end event is recorded (so the step's work on all GPUs is inside the interval); otherwise with
`time.perf_counter`. The step time reported is the median. Peak memory per real CUDA device is
`torch.cuda.max_memory_allocated` over the timed steps (CPU memory is not measured per device).

Every run can append one calibration record (JSON lines, `"format": "devplace.run/1"`) that
`devplace calibrate --runs FILE` folds into measured/simulated step-time ratios per device kind.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from devplace.defaults import MAX_STEPS
from devplace.errors import DevplaceError
from devplace.files import JSON_LINES_RUN, append_output, json_text

__all__ = ["RUN_FORMAT", "PrecisionError", "RunResult", "append_record", "apply_precision", "autocast_dtype",
           "check_steps", "local_cluster", "measure_plan", "plan_precision", "precision_record", "run_record",
           "run_steps"]

RUN_FORMAT = "devplace.run/1"


@dataclass
class RunResult:
    """Measured training steps: each timed step's seconds, their median, the timer, the losses, the peak
    memory of each real CUDA device used (empty on CPU), and each timed step's CPU seconds (this process's
    `time.process_time`, every thread of it; for several processes, their sum)."""

    step_times_s: list[float]
    timer: str
    losses: list[float] = field(default_factory=list)
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    cpu_times_s: list[float] = field(default_factory=list)

    @property
    def step_time_s(self) -> float:
        """Median of the timed steps."""
        return statistics.median(self.step_times_s)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median of the timed steps: above `NOISY_SPREAD` the median is not to be trusted
        (another job on the machine, too few threads for the work)."""
        median = self.step_time_s
        return (max(self.step_times_s) - min(self.step_times_s)) / median if median > 0 else 0.0

    @property
    def cores_busy(self) -> float | None:
        """CPU seconds per wall-clock second of the timed steps (None: not measured): with one thread, 1.0 when
        the step had a core all the time, less when it waited for one (other jobs on the machine) or for a
        peer (a pipeline stage waiting for its input)."""
        wall = sum(self.step_times_s)
        return sum(self.cpu_times_s) / wall if self.cpu_times_s and wall > 0 else None


NOISY_SPREAD = 0.2  # steps varying by more than this share of their median: `devplace run` warns


def _as_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


def _make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    # the same optimizers, with the same settings, as the capture records (capture/torch_capture.py)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, foreach=False)
    if name == "none":
        return None
    raise DevplaceError(f"unknown optimizer {name!r}; use adam, sgd or none (as for the capture)")


def cpu_autocast(dtype: torch.dtype | None) -> Any:
    """The CPU's autocast to `dtype`, or no context for None."""
    # the CPU's autocast, as the capture records it (its fake tensors live on the CPU); a placed module's trace,
    # taken under it, carries the casts as ops, so they run on whatever device each op is placed on
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()


def check_steps(steps: int, warmup: int) -> None:
    """Refuse, before any work, step counts out of range (1..MAX_STEPS timed, 0..MAX_STEPS warm-up)."""
    if not 1 <= steps <= MAX_STEPS or not 0 <= warmup <= MAX_STEPS:
        raise DevplaceError(f"need --steps from 1 to {MAX_STEPS:,} and --warmup from 0 to {MAX_STEPS:,}, got "
                            f"steps={steps}, warmup={warmup}")


def run_steps(module: nn.Module, inputs: Any, *, steps: int = 5, warmup: int = 2, optimizer: str = "adam",
              loss_fn: Callable[[Any], torch.Tensor] | None = None,
              devices: Sequence[torch.device] | None = None, autocast: torch.dtype | None = None,
              passes: int = 1) -> RunResult:
    """Run `warmup` + `steps` training steps (forward, loss, backward, optimizer step, zero_grad) of `module`
    on `inputs` and time the last `steps`. `devices`: the real devices in use (default: those of the
    module's parameters), to synchronise and to read peak memory from. `autocast`: run the forward and the
    loss under `torch.autocast` to this dtype, as `capture(amp=True)` records them. `passes`: forward, loss and
    backward that many times per step before the update, each pass after the first adding its gradients into
    .grad as a pipeline's later micro-batches do, then every gradient divided by `passes` as torch's pipelining
    divides a mean loss's (`runtime.in_step` times those adds and divisions); a step's loss is the last pass's."""
    check_steps(steps, warmup)
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    from devplace.capture.torch_capture import default_loss

    loss_of = loss_fn or default_loss
    args, kwargs = _as_args(inputs)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = _make_optimizer(optimizer, params)
    devs = list(dict.fromkeys(devices if devices is not None else [p.device for p in module.parameters()]))
    cuda = [d for d in devs if d.type == "cuda"]

    def step() -> float:
        for _ in range(passes):
            with cpu_autocast(autocast):
                loss = loss_of(module(*args, **kwargs))
                if loss.numel() != 1:
                    loss = loss.sum()
            loss.backward()
        if passes > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(passes)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            module.zero_grad(set_to_none=True)
        return float(loss.detach())

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    losses = [step() for _ in range(warmup)]
    sync()
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    times: list[float] = []
    cpu_times: list[float] = []
    for _ in range(steps):
        c0 = time.process_time()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.device(cuda[0]):
                start.record()
                value = step()  # float(loss) waits for the loss, not for backward and the update
                for d in cuda[1:]:
                    torch.cuda.synchronize(d)
                end.record()
            torch.cuda.synchronize(cuda[0])
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            value = step()
            times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        losses.append(value)
    peaks = {str(d): int(torch.cuda.max_memory_allocated(d)) for d in cuda}
    return RunResult(times, "cuda-events" if cuda else "perf_counter", losses, peaks, cpu_times)


def run_record(run: RunResult, *, graph: str, cluster: Any, devices: Sequence[torch.device | str],
               simulated_step_s: float, simulated_peak_bytes: Sequence[float] = (),
               settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """One calibration record (`devplace.run/1`): what ran where, measured and simulated step time."""
    kinds = [d.kind or d.name for d in cluster.devices] if cluster is not None else []
    return {
        "format": RUN_FORMAT, "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "graph": graph, "cluster": getattr(cluster, "name", ""), "device_kinds": kinds,
        "devices": [str(d) for d in devices], "settings": dict(settings or {}), "torch": torch.__version__,
        "timer": run.timer, "steps": len(run.step_times_s), "measured_step_s": run.step_time_s,
        "measured_steps_s": list(run.step_times_s), "measured_spread": run.spread,
        "measured_cpu_steps_s": list(run.cpu_times_s),
        "threads": torch.get_num_threads(), "simulated_step_s": simulated_step_s,
        "ratio": run.step_time_s / simulated_step_s if simulated_step_s > 0 else None,
        "peak_memory_bytes": dict(run.peak_memory_bytes), "simulated_peak_memory_bytes": list(simulated_peak_bytes),
        "losses": list(run.losses),
    }


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append `record` as one JSON line to `path` (atomically; only to a file of such records, unless --force)."""
    append_output(path, json_text(record, sort_keys=True) + "\n", "--record", JSON_LINES_RUN)


# Assumed links of a machine's own devices (not measured): PCIe gen3 x16 effective between two GPUs and between
# CPU and GPU; between logical devices that share one real device, a copy at that device's memory bandwidth.
LOCAL_LINK_BPS = 12e9
LOCAL_LINK_LATENCY_S = 1e-5


def local_cluster(devices: Sequence[torch.device | str], specs: Mapping[torch.device, Any] | None = None) -> Any:
    """A cluster of this machine's real devices, one per logical device, with measured speeds
    (`local_cpu_device`, `local_cuda_device`, or the `Device` given in `specs` for a real device -- pass the one
    a cost table was measured with, so the table's times and the cluster's speeds agree) and the assumed links
    above."""
    from devplace.capture.profile import local_cpu_device, local_cuda_device
    from devplace.hardware.cluster import Cluster, Link

    real = [torch.device(d) for d in devices]
    measured: dict[torch.device, Any] = dict(specs or {})
    devs = []
    for i, d in enumerate(real):
        if d not in measured:
            measured[d] = local_cpu_device() if d.type == "cpu" else local_cuda_device(d.index or 0)
        devs.append(dataclasses.replace(measured[d], name=f"{d}#{i}"))  # every figure kept, per-precision peaks too
    links = {(a, b): Link(devs[a].mem_bandwidth_Bps or LOCAL_LINK_BPS, 0.0)
             for a in range(len(real)) for b in range(len(real)) if a != b and real[a] == real[b]}
    return Cluster(f"local:{','.join(map(str, real))}", tuple(devs), Link(LOCAL_LINK_BPS, LOCAL_LINK_LATENCY_S),
                   links, meta={"description": "this machine's devices, speeds measured, links assumed"})


class PrecisionError(DevplaceError):
    """A module that cannot run in the precision its plan was captured in."""


def _float_dtype(module: nn.Module) -> str | None:
    """The floating-point dtype holding most of `module`'s parameter bytes, named as capture meta names it."""
    size: dict[str, int] = {}
    for t in module.parameters():
        if t.is_floating_point():
            name = str(t.dtype).removeprefix("torch.")
            size[name] = size.get(name, 0) + t.numel() * t.element_size()
    return max(size, key=lambda k: size[k]) if size else None


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, Mapping):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, tuple | list):
        return type(inputs)(_cast_inputs(v, dtype) for v in inputs)
    return inputs


def precision_record(p: Any) -> dict[str, str]:
    """What running plan `p`'s steps in the precision it was captured in takes, without the module (what a
    pipeline or parallel export records, `devplace export`): "dtype", the precision ("bf16", ...) that a plan made
    with `dtype=` and without `amp` casts the module and the floating-point inputs to, as the capture did; and
    "autocast", the torch name ("bfloat16") of the dtype an `amp` plan's forward and loss run under
    `torch.autocast` to, as the capture recorded it. Empty for an fp32 plan. Raises PrecisionError for an
    unknown dtype or a plan that needs fp32 master weights (amp with bf16/fp16 parameters), which
    devplace.runtime does not keep."""
    from devplace.capture.torch_capture import DTYPES

    s = p.settings
    dtype, amp = s.get("dtype"), bool(s.get("amp", False))
    if dtype is not None and dtype not in DTYPES:
        raise PrecisionError(f"the plan's dtype {dtype!r} is none of {', '.join(DTYPES)}; is the plan file edited?")
    out = {"dtype": dtype} if dtype is not None and not amp else {}
    cap = p.graph.meta.get("capture") if isinstance(p.graph.meta, Mapping) else None
    if not isinstance(cap, Mapping):
        if amp:
            out["autocast"] = str(DTYPES[dtype or "bf16"]).removeprefix("torch.")
        return out
    if cap.get("master_weight_bytes"):
        raise PrecisionError(f"plan {p.graph.name!r} trains {cap.get('dtype')} parameters under amp with fp32 master "
                             "weights, which devplace.runtime does not keep; plan fp32 parameters with amp, or the "
                             f"{cap.get('dtype')} model without amp")
    auto = cap.get("amp")  # the autocast dtype's torch name ("bfloat16"), or None
    if auto:
        autocast_dtype(str(auto), f"plan {p.graph.name!r}")
        out["autocast"] = str(auto)
    return out


def autocast_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype `name` ("bfloat16") that `where` records autocast to; PrecisionError if it is none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise PrecisionError(f"{where} records autocast to {name!r}, which is no torch floating-point dtype")
    return dtype


def apply_precision(record: Mapping[str, str], module: nn.Module, inputs: Any, where: str = "the plan",
                    ) -> tuple[Any, torch.dtype | None]:
    """(inputs, autocast dtype) to run `module`'s steps in the precision `record` (`precision_record`) gives:
    casts `module` in place and the floating-point `inputs` for a "dtype", and returns the "autocast" dtype
    (None: no autocast)."""
    from devplace.capture.torch_capture import DTYPES

    dtype = record.get("dtype")
    if dtype is not None:
        if dtype not in DTYPES:
            raise PrecisionError(f"{where} records dtype {dtype!r}, none of {', '.join(DTYPES)}")
        module.to(DTYPES[dtype])
        inputs = _cast_inputs(inputs, DTYPES[dtype])
    auto = record.get("autocast")
    return inputs, autocast_dtype(auto, where) if auto is not None else None


def plan_precision(p: Any, module: nn.Module, inputs: Any) -> tuple[Any, torch.dtype | None]:
    """(inputs, autocast dtype) to run plan `p`'s steps of `module` in the precision it was captured in
    (`precision_record`, `apply_precision`). Raises PrecisionError as `precision_record` does, and when the
    module's parameters are in another dtype than the captured ones (e.g. an fp32 module for a plan captured
    from a bf16 one)."""
    inputs, autocast = apply_precision(precision_record(p), module, inputs, f"plan {p.graph.name!r}")
    cap = p.graph.meta.get("capture") if isinstance(p.graph.meta, Mapping) else None
    want = cap.get("dtype") if isinstance(cap, Mapping) else None
    have = _float_dtype(module)
    if want is not None and have is not None and want != have:
        raise PrecisionError(f"plan {p.graph.name!r} was captured with {want} parameters but this module's are "
                             f"{have}; run it in the plan's precision (module.to(torch.{want})) or plan this "
                             "module as it is")
    return inputs, autocast


def measure_plan(p: Any, module: nn.Module, inputs: Any, devices: Sequence[str | torch.device] | str, *,
                 steps: int = 5, warmup: int = 2, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 ) -> tuple[Any, RunResult, dict[str, Any]]:
    """Apply plan `p` to `module` on `devices`, run and time training steps in the plan's precision
    (`plan_precision`; the loss: `loss_fn`, else the plan's own), and build the calibration record, whose
    simulated figures are those of `p.runtime_placement` (the placement as it runs).
    Returns (placed module, measurement, record)."""
    inputs, autocast = plan_precision(p, module, inputs)
    with cpu_autocast(autocast):  # the trace apply takes must see the casts the capture saw
        placed = p.apply(module, devices, example_inputs=inputs)
    run = run_steps(placed, inputs, steps=steps, warmup=warmup, optimizer=str(p.settings.get("optimizer", "adam")),
                    loss_fn=loss_fn or getattr(p, "loss_fn", None), devices=placed.devices, autocast=autocast)
    s = p.settings
    shared = shared_simulation(p.graph, p.cluster, p.runtime_placement, placed.devices)
    sim = shared if shared is not None else p.runtime_result
    rec = run_record(run, graph=p.graph.name, cluster=p.cluster, devices=placed.devices,
                     simulated_step_s=sim.step_time_s,
                     simulated_peak_bytes=[float(x) for x in sim.peak_memory_bytes],
                     settings={"placer": s.get("placer"), "order": s.get("order"), "seed": s.get("seed"),
                               "planned_step_s": p.result.step_time_s,
                               "as_run_on_separate_devices_s": p.runtime_result.step_time_s,
                               "shared_devices": shared is not None,
                               "granularity": placed.granularity, "crossings": placed.crossings,
                               "source": s.get("source")})
    return placed, run, rec


def shared_simulation(graph: Any, cluster: Any, placement: Any, devices: Sequence[torch.device]) -> Any:
    """The step of `placement` as it runs when logical devices share real ones (`--devices cpu,cpu`): the
    logical devices on one real device merged into one simulated device (the first one's figures), which runs
    their ops one at a time as the real device does; None when every logical device has a real device of its
    own. The plan's own simulation runs them in parallel, which no real device does (issue 23: a claimed 3.62x
    speed-up of two logical devices on one CPU)."""
    from devplace.hardware.cluster import Cluster
    from devplace.sim import DevplaceModel

    used = [torch.device(d) for d in devices][: cluster.num_devices]
    real = list(dict.fromkeys(used))
    if len(real) == len(used):
        return None
    first = [used.index(r) for r in real]  # the logical device whose figures each real device keeps
    links = {(a, b): cluster.pair(first[a], first[b]) for a in range(len(real)) for b in range(len(real))
             if a != b}
    merged = Cluster(f"{cluster.name} as run on {','.join(map(str, real))}",
                     tuple(cluster.devices[i] for i in first), cluster.link, links, dict(cluster.meta))
    index = np.array([real.index(d) for d in used], dtype=np.int64)
    return DevplaceModel(graph, merged).run(index[placement.to_array(graph, cluster.num_devices)])
