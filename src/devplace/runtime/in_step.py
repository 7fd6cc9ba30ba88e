"""Profiling ops where they run: inside real training steps (`profile_in_step`, `devplace profile --in-step`).

`capture.profile.profile_graph` times each distinct op alone, many times over on the same inputs, which then sit
in the cache; in a real step an op's inputs were written by other ops a while before, its output lands in memory
the allocator hands out between other ops, and the optimizer's update walks every parameter, gradient and state
once. On this CPU the step's elementwise ops ran 1.8-2.8x and its optimizer 2-3x their isolated times
(docs/performance.md, "Measured vs simulated"). `profile_in_step` instead runs `warmup` + `steps` training steps
of the model (forward, loss, backward, the optimizer's step: `runtime.run.run_steps`, as `devplace run` runs
them on one device) and, during the last `steps`, times every ATen op the step dispatches by this thread's CPU
clock around its call (a `TorchDispatchMode`; other processes on the cores do not count), keyed by its signature
(`capture.signature.encode_signature`, the key of the captured node it is, floats aside). A signature's entry is
the mean of its calls in a step, the median over the steps, so that a step that another process slowed (caches
are shared) does not count; views and other ops the graph folds are timed but match no node.

The timer's window sees only the kernel: not the autograd recording a forward op does above the dispatch mode,
nor the engine's work between backward ops, and it adds its own cost and cache traffic to every op. So as many
untimed steps again run between the timed ones (without the mode), each phase of them (forward, backward, the
optimizer's update) timed whole, and every op's time is scaled by its phase's factor: the phase's CPU seconds in
an untimed step over its graph ops' timed seconds in a timed step. The graph's ops of each phase then sum to what
the phase took. On this CPU the factors were 1.5-1.9 for the forward, 1.0-1.2 for the backward and 0.7-0.9 for
the update (a T5, batch 8 and 2); unscaled, a pipeline stage's forwards ran 1.5-1.7x their simulated time while
the one-device step, where the phases' errors cancel, looked right (docs/performance.md, "Action by action").
The table's `meta["phase_factors"]` keeps them.

The adds of a later micro-batch's gradients into `.grad` (a node's `accumulates`, `graph.phases`) and their
division by M are timed the same way in as many steps again that run forward and backward twice before the update
(`run_steps(passes=2)`): the second backward's AccumulateGrad adds each gradient into `.grad` where a pipeline's
later micro-batches do, and each gradient is then divided by 2 as torch's pipelining divides a mean loss's.

The table this gives is an ordinary `devplace.costs/1` table with `meta["timer"] = "in-step"`; ops no step ran (a
micro-batch size the steps did not use) fall back to what `merge_tables` puts beneath it (the isolated profile).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from devplace.capture.signature import encode_signature
from devplace.graph.compgraph import CompGraph
from devplace.graph.phases import SCALE_BY
from devplace.graph.placement import Placement
from devplace.hardware.cluster import Device
from devplace.hardware.cost import CostError, CostTable, node_signatures, signature_key
from devplace.runtime.apply import apply_placement
from devplace.runtime.run import check_steps, run_steps

__all__ = ["IN_STEP", "TimeEachOp", "merge_tables", "profile_in_step"]

IN_STEP = "in-step"  # the cost table's meta["timer"] for times measured inside real steps


class TimeEachOp(TorchDispatchMode):
    """While `on`, times each dispatched ATen call by this thread's CPU clock (other processes on the cores do
    not count) and hands it to `record(func, args, kwargs, seconds)`, after the call: an op that writes its input
    in place keeps its shape, and the recorder's own Python stays outside the timed window. Used by
    `profile_in_step` and by benchmarks/sim_vs_real.py's per-class times."""

    def __init__(self, record: Callable[[Any, Any, Mapping[str, Any], float], None]) -> None:
        super().__init__()
        self.record = record
        self.on = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.on:
            return func(*args, **kwargs)
        t0 = time.thread_time_ns()
        out = func(*args, **kwargs)
        dt = time.thread_time_ns() - t0
        self.record(func, args, kwargs, dt / 1e9)
        return out


def _shape_key(sig: Mapping[str, Any]) -> str:
    """`signature_key` with every float argument left out: what an op costs does not hang on a scale's value,
    and the optimizer's (bias corrections, step sizes) change from step to step."""
    def strip(x: Any) -> Any:
        if isinstance(x, float):
            return "float"
        if isinstance(x, list):
            return [strip(i) for i in x]
        if isinstance(x, Mapping) and "tensor" not in x:
            return {k: strip(v) for k, v in x.items()}
        return x

    return signature_key(strip(dict(sig)))


def profile_in_step(graph: CompGraph, module: nn.Module, inputs: Any, device_spec: Device, *, steps: int = 5,
                    warmup: int = 3, optimizer: str = "adam",
                    loss_fn: Callable[[Any], torch.Tensor] | None = None) -> CostTable:
    """The thread CPU seconds of each op of `graph` (the captured step of `module` on `inputs`) in `steps` real
    training steps, after `warmup` untimed ones: `module` placed whole on the CPU as `devplace run --plan` runs a
    one-device plan (`runtime.apply`: the traced program the capture's ops come from), with `optimizer` and
    `loss_fn` as captured; a cost table of `device_spec`'s kind (see the module docstring). A node's entry is the
    median over the steps of its signature's mean call (floats aside: `_shape_key`). Trains `module`."""
    check_steps(steps, warmup)
    if any(p.device.type != "cpu" for p in module.parameters()):
        raise CostError("profile_in_step times ops by the CPU clock, so the model must be on the CPU; profile a "
                        "GPU's ops with `devplace profile --device cuda` (alone, by CUDA events)")
    placed = apply_placement(module, graph, Placement.from_array(graph, [0] * graph.num_nodes), ["cpu"],
                             example_inputs=inputs)
    keys = {_shape_key(x["sig"]) for x in graph.node_extra if isinstance(x.get("sig"), dict)}
    seconds, calls, factors = _timed(placed, inputs, steps=steps, warmup=warmup, optimizer=optimizer,
                                     loss_fn=loss_fn, graph_keys=keys)
    # the adds of later micro-batches' gradients into .grad and their division by M (`graph.phases`, gradient
    # accumulation): a one-device step makes neither, so as many steps again of two passes each, timed where they run
    added, more, _ = _timed(placed, inputs, steps=steps, warmup=1, optimizer=optimizer, loss_fn=loss_fn,
                            passes=SCALE_BY)  # the divisor the divisions' signatures were recorded with
    entries: dict[str, float] = {}
    for extra in graph.node_extra:
        sig = extra.get("sig")
        for s in node_signatures(extra):
            t = (seconds if s is sig else added).get(_shape_key(s))
            if t is not None:
                entries[signature_key(s)] = t
    return CostTable(device_kind=device_spec.kind, entries=entries, torch=torch.__version__, warmup=warmup,
                     repeats=steps, device=device_spec,
                     meta={"timer": IN_STEP, "statistic": "median over steps of the mean, scaled by its phase's factor",
                           "threads": torch.get_num_threads(), "calls": calls + more, "signatures": len(entries),
                           "phase_factors": factors})


PHASES = ("forward", "backward", "update")


def _timed(placed: nn.Module, inputs: Any, *, steps: int, warmup: int, optimizer: str,
           loss_fn: Callable[[Any], torch.Tensor] | None, passes: int = 1,
           graph_keys: set[str] | None = None) -> tuple[dict[str, float], int, dict[str, float]]:
    """Run `warmup` + `steps` steps of `passes` passes each (`run_steps`) and time every op of the last `steps`:
    (shape key -> the median over the steps of its calls' mean in a step, the calls timed, the phase factors).

    With `graph_keys` (the shape keys of the graph's nodes) as many untimed steps again run between the timed
    ones, each phase of them (forward, loss and backward, the update) timed whole by the thread's CPU clock; an
    op's time is then scaled by its phase's factor: the phase's CPU seconds in an untimed step over its ops'
    timed seconds in a timed step (medians over the steps), counting only ops that are nodes of the graph, so that
    the graph's ops of each phase sum to what the phase took. What the timer cannot see goes with them: the
    autograd recording a forward op does above the dispatch mode, the engine's work between backward ops, the
    timer's own cost inside its window and what it does to the caches (on this CPU: forward 1.5-1.9, backward
    1.0-1.2, update 0.7-0.9). Without it, factors of 1."""
    calls: dict[str, dict[int, list[tuple[float, str]]]] = {}  # shape key -> step -> its calls' (seconds, phase)
    forwards = [0]
    now: dict[str, Any] = {"phase": "", "step": 0, "start": 0.0}  # the phase running, its step, its start
    clock: dict[int, dict[str, float]] = {}  # untimed step -> phase -> CPU seconds
    timed_every = 2 if graph_keys is not None else 1  # alternate: a drift in the machine's speed hits both alike

    def timed(step: int) -> bool:
        return step > warmup and (step - warmup - 1) % timed_every == 0

    def record(func: Any, args: Any, kwargs: Mapping[str, Any], seconds: float) -> None:
        key = _shape_key(encode_signature(func, args, kwargs))
        calls.setdefault(key, {}).setdefault(now["step"], []).append((seconds, now["phase"]))

    timer = TimeEachOp(record)
    active = [False]

    def switch(to: str) -> None:
        t = time.thread_time()
        if now["phase"] in PHASES and now["step"] > warmup and not timed(now["step"]):
            by_phase = clock.setdefault(now["step"], {})
            by_phase[now["phase"]] = by_phase.get(now["phase"], 0.0) + t - now["start"]
        now.update(phase=to, start=t)

    def count(*_: Any) -> None:  # a step's ops (forwards, losses, backwards, update) follow its first forward's start
        forwards[0] += 1
        step = (forwards[0] - 1) // passes + 1
        if timed(step) != active[0]:  # the untimed steps run without the dispatch mode: it costs every op's call
            if active[0]:
                timer.__exit__(None, None, None)
            else:
                timer.__enter__()
            active[0] = not active[0]
        switch("forward")
        now["step"] = step

    hooks = [placed.register_forward_pre_hook(count), placed.register_forward_hook(lambda *_: switch("backward")),
             register_optimizer_step_pre_hook(lambda *_: switch("update")),
             register_optimizer_step_post_hook(lambda *_: switch("after"))]
    try:
        run_steps(placed, inputs, steps=steps * timed_every, warmup=warmup, optimizer=optimizer, loss_fn=loss_fn,
                  passes=passes)
    finally:
        if active[0]:
            timer.__exit__(None, None, None)
        for hook in hooks:
            hook.remove()
    factors = {p: 1.0 for p in PHASES}
    if graph_keys is not None:
        for p in PHASES:
            real = [c[p] for c in clock.values() if p in c]
            seen = [sum(sec for k, by_step in calls.items() if k in graph_keys for sec, ph in by_step.get(s, ())
                        if ph == p) for s in {s for by_step in calls.values() for s in by_step}]
            if real and seen and statistics.median(seen) > 0:
                factors[p] = statistics.median(real) / statistics.median(seen)
    # per signature, its calls' mean in each step, the median over the steps: robust to a step that another
    # process slowed (shared caches), and the ops of a step still sum to what they took in it
    seconds = {k: statistics.median(sum(sec * factors.get(ph, 1.0) for sec, ph in c) / len(c) for c in by_step.values())
               for k, by_step in calls.items()}
    return seconds, sum(len(c) for v in calls.values() for c in v.values()), factors


def merge_tables(tables: Sequence[CostTable]) -> CostTable:
    """One table of several of one device kind, a later table's entry winning over an earlier one's for the same
    signature (an in-step profile over the isolated one, a micro-batch's beside the whole batch's); `skipped`
    keeps what no table measured, `meta` and `overheads` are the last table's."""
    if not tables:
        raise ValueError("merge_tables needs at least one table")
    last = tables[-1]
    kinds = {t.device_kind for t in tables}
    if len(kinds) > 1:
        raise CostError(f"cannot merge cost tables of different devices ({', '.join(sorted(kinds))}); profile "
                        "them on one device kind")
    entries: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for t in tables:
        entries.update(t.entries)
        skipped.update(t.skipped)
    return CostTable(device_kind=last.device_kind, entries=entries, torch=last.torch, warmup=last.warmup,
                     repeats=last.repeats, skipped={k: v for k, v in skipped.items() if k not in entries},
                     device=last.device or next((t.device for t in tables if t.device is not None), None),
                     meta=dict(last.meta), overheads=last.overheads)
