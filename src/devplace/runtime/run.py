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

import datetime
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from devplace.errors import DevplaceError

__all__ = ["RUN_FORMAT", "RunResult", "append_record", "local_cluster", "measure_plan", "run_record",
           "run_steps"]

RUN_FORMAT = "devplace.run/1"


@dataclass
class RunResult:
    """Measured training steps: each timed step's seconds, their median, the timer, the losses, and the peak
    memory of each real CUDA device used (empty on CPU)."""

    step_times_s: list[float]
    timer: str
    losses: list[float] = field(default_factory=list)
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        """Median of the timed steps."""
        return statistics.median(self.step_times_s)


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


def run_steps(module: nn.Module, inputs: Any, *, steps: int = 5, warmup: int = 2, optimizer: str = "adam",
              loss_fn: Callable[[Any], torch.Tensor] | None = None,
              devices: Sequence[torch.device] | None = None) -> RunResult:
    """Run `warmup` + `steps` training steps (forward, loss, backward, optimizer step, zero_grad) of `module`
    on `inputs` and time the last `steps`. `devices`: the real devices in use (default: those of the
    module's parameters), to synchronise and to read peak memory from."""
    if steps < 1 or warmup < 0:
        raise DevplaceError(f"need --steps >= 1 and warm-up >= 0, got steps={steps}, warmup={warmup}")
    from devplace.capture.torch_capture import default_loss

    loss_of = loss_fn or default_loss
    args, kwargs = _as_args(inputs)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = _make_optimizer(optimizer, params)
    devs = list(dict.fromkeys(devices if devices is not None else [p.device for p in module.parameters()]))
    cuda = [d for d in devs if d.type == "cuda"]

    def step() -> float:
        loss = loss_of(module(*args, **kwargs))
        if loss.numel() != 1:
            loss = loss.sum()
        loss.backward()
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
    for _ in range(steps):
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
        losses.append(value)
    peaks = {str(d): int(torch.cuda.max_memory_allocated(d)) for d in cuda}
    return RunResult(times, "cuda-events" if cuda else "perf_counter", losses, peaks)


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
        "measured_steps_s": list(run.step_times_s), "simulated_step_s": simulated_step_s,
        "ratio": run.step_time_s / simulated_step_s if simulated_step_s > 0 else None,
        "peak_memory_bytes": dict(run.peak_memory_bytes), "simulated_peak_memory_bytes": list(simulated_peak_bytes),
        "losses": list(run.losses),
    }


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append `record` as one JSON line to `path`."""
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


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
        m = measured[d]
        devs.append(type(m)(name=f"{d}#{i}", memory_bytes=m.memory_bytes, speed=m.speed, peak_flops=m.peak_flops,
                            mem_bandwidth_Bps=m.mem_bandwidth_Bps, kind=m.kind))
    links = {(a, b): Link(devs[a].mem_bandwidth_Bps or LOCAL_LINK_BPS, 0.0)
             for a in range(len(real)) for b in range(len(real)) if a != b and real[a] == real[b]}
    return Cluster(f"local:{','.join(map(str, real))}", tuple(devs), Link(LOCAL_LINK_BPS, LOCAL_LINK_LATENCY_S),
                   links, meta={"description": "this machine's devices, speeds measured, links assumed"})


def measure_plan(p: Any, module: nn.Module, inputs: Any, devices: Sequence[str | torch.device] | str, *,
                 steps: int = 5, warmup: int = 2, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 ) -> tuple[Any, RunResult, dict[str, Any]]:
    """Apply plan `p` to `module` on `devices`, run and time training steps, and build the calibration record,
    whose simulated figures are those of `p.runtime_placement` (the placement as it runs).
    Returns (placed module, measurement, record)."""
    placed = p.apply(module, devices, example_inputs=inputs)
    run = run_steps(placed, inputs, steps=steps, warmup=warmup, optimizer=str(p.settings.get("optimizer", "adam")),
                    loss_fn=loss_fn, devices=placed.devices)
    s = p.settings
    rec = run_record(run, graph=p.graph.name, cluster=p.cluster, devices=placed.devices,
                     simulated_step_s=p.runtime_result.step_time_s,
                     simulated_peak_bytes=[float(x) for x in p.runtime_result.peak_memory_bytes],
                     settings={"placer": s.get("placer"), "order": s.get("order"), "seed": s.get("seed"),
                               "planned_step_s": p.result.step_time_s,
                               "granularity": placed.granularity, "crossings": placed.crossings,
                               "source": s.get("source")})
    return placed, run, rec
