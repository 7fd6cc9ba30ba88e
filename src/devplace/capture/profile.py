"""Profiled cost model: run each distinct op signature of a captured graph for real and time it.

`profile_graph(graph, device)` decodes every distinct node `sig` (`decode_signature`: random tensors of the
captured shapes, dtypes and strides on `device`), runs it `warmup` times, then times `repeats` runs
(`time.perf_counter` around each call on CPU; CUDA events around each call on a GPU) and keeps the median,
in a `CostTable` keyed by `signature_key(sig)`. A signature that cannot be rebuilt or run (unknown op, out
of memory, an op that needs data-dependent inputs) is not timed: the table lists it under `skipped` with the
reason, and the cost model falls back to the analytic roofline for it.

`calibrate(graph, table, device)` compares the analytic roofline with the measurements, per op class.

A CPU has no datasheet preset, so `local_cpu_device()` describes this machine's CPU by **measuring** it:
`peak_flops` is the best float32 FLOP/s of a 1024x1024x1024 matmul, `mem_bandwidth_Bps` the best
bytes/s (read + write) of copying a 64 MiB float32 buffer, both with torch's current thread count, and
`speed = peak_flops / 125e12` as for the presets. `local_cpu_roofline()` adds the measured per-op overheads
(median time of an `add` on one-element tensors, and of a `view`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from devplace.capture.signature import decode_signature
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Device
from devplace.hardware.cost import (
    OP_CLASSES,
    CostError,
    CostTable,
    Roofline,
    analytic_node_time,
    node_signatures,
    op_class,
    roofline_for,
    signature_key,
)
from devplace.hardware.presets import V100_PEAK_FLOPS

__all__ = ["CpuFigures", "calibrate", "format_calibration", "local_cpu_device", "local_cpu_roofline",
           "measure_local_cpu", "profile_graph", "time_op"]

ProgressFn = Callable[[int, int, str], None]


# ==================================================================================== the local CPU
@dataclasses.dataclass(frozen=True)
class CpuFigures:
    """Measured figures of this machine's CPU (see the module docstring)."""

    model: str
    threads: int
    peak_flops: float  # float32 FLOP/s of a 1024^3 matmul, best of the runs
    mem_bandwidth_Bps: float  # bytes read + written per second copying 64 MiB, best of the runs
    launch_overhead_s: float  # median seconds of a one-element add (dispatch overhead)
    view_overhead_s: float  # median seconds of a view (dispatch, no kernel)
    memory_bytes: float


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _physical_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def _best(fn: Callable[[], Any], runs: int) -> float:
    fn()
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=4)
def _measure(threads: int) -> CpuFigures:
    with torch.no_grad():
        n = 1024
        a = torch.rand(n, n)
        b = torch.rand(n, n)
        out = torch.empty(n, n)
        mm_flops = 2 * n**3 / _best(lambda: torch.mm(a, b, out=out), 5)
        x4 = torch.rand(8, 128, 32, 32)
        w4 = torch.rand(128, 128, 3, 3)
        conv = torch.ops.aten.convolution.default
        conv_flops = 2 * x4.numel() * 128 * 9 / _best(lambda: conv(x4, w4, None, [1, 1], [1, 1], [1, 1], False,
                                                                    [0, 0], 1), 5)
        src = torch.rand(16 * 2**20)  # 64 MiB
        dst = torch.empty_like(src)
        t_copy = _best(lambda: dst.copy_(src), 5)
        x = torch.rand(1)
        aten_add = torch.ops.aten.add.Tensor
        y = torch.rand(1)
        overheads = []
        for op, args in ((aten_add, (x, y)), (torch.ops.aten.view.default, (x, [1, 1]))):
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    op(*args)
                samples.append((time.perf_counter() - t0) / 200)
            overheads.append(statistics.median(samples))
    return CpuFigures(model=_cpu_model(), threads=threads, peak_flops=max(mm_flops, conv_flops),
                      mem_bandwidth_Bps=2 * src.numel() * src.element_size() / t_copy,
                      launch_overhead_s=overheads[0], view_overhead_s=overheads[1],
                      memory_bytes=_physical_memory())


def measure_local_cpu(refresh: bool = False) -> CpuFigures:
    """Measure this CPU (about a second; cached per thread count unless `refresh`)."""
    if refresh:
        _measure.cache_clear()
    return _measure(torch.get_num_threads())


def local_cpu_device(name: str = "cpu0", refresh: bool = False) -> Device:
    """This machine's CPU as a `Device` with measured `peak_flops` and `mem_bandwidth_Bps`.

    kind is ``"cpu: <model name> x<threads>"`` (the thread count changes the figures, so it is part of the
    kind a cost table is matched by); speed is ``peak_flops / 125e12`` as for the GPU presets.
    """
    f = measure_local_cpu(refresh)
    return Device(name=name, memory_bytes=f.memory_bytes, speed=f.peak_flops / V100_PEAK_FLOPS,
                  peak_flops=f.peak_flops, mem_bandwidth_Bps=f.mem_bandwidth_Bps, kind=_cpu_kind(f))


def _cpu_kind(f: CpuFigures) -> str:
    return f"cpu: {f.model} x{f.threads}"


def local_cpu_roofline(refresh: bool = False) -> Roofline:
    """`CPU_ROOFLINE` with the per-op overheads measured on this machine (`launch_overhead_s`, `view_s`)."""
    f = measure_local_cpu(refresh)
    return dataclasses.replace(roofline_for(Device("cpu", 0.0, kind="cpu")), name="cpu (measured overhead)",
                               launch_overhead_s=f.launch_overhead_s, view_s=f.view_overhead_s)


def local_cuda_device(index: int = 0) -> Device:
    """The CUDA device `index` with measured figures: `peak_flops` from a 4096^3 float16 matmul (tensor cores),
    `mem_bandwidth_Bps` from a 256 MiB copy; kind ``"cuda: <device name>"``."""
    dev = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(dev)
    with torch.no_grad():
        n = 4096
        a = torch.rand(n, n, device=dev, dtype=torch.float16)
        b = torch.rand(n, n, device=dev, dtype=torch.float16)
        t_mm = min(time_op(torch.mm, [a, b], {}, dev, warmup=3, repeats=10))
        src = torch.rand(64 * 2**20, device=dev)
        dst = torch.empty_like(src)
        t_copy = min(time_op(dst.copy_, [src], {}, dev, warmup=3, repeats=10))
    peak = 2 * n**3 / t_mm
    return Device(name=f"cuda{index}", memory_bytes=float(props.total_memory), speed=peak / V100_PEAK_FLOPS,
                  peak_flops=peak, mem_bandwidth_Bps=2 * src.numel() * 4 / t_copy, kind=f"cuda: {props.name}")


# ==================================================================================== timing
def time_op(func: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], device: torch.device,
            warmup: int = 3, repeats: int = 10) -> list[float]:
    """Seconds of each of `repeats` calls of func(*args, **kwargs) after `warmup` untimed calls."""
    cuda = device.type == "cuda"
    with torch.no_grad():
        for _ in range(warmup):
            func(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize(device)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for s, e in zip(starts, ends, strict=True):
                s.record()
                func(*args, **kwargs)
                e.record()
            torch.cuda.synchronize(device)
            return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            func(*args, **kwargs)
            times.append(time.perf_counter() - t0)
        return times


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def profile_graph(graph: CompGraph, device: str | torch.device = "cpu", warmup: int = 3, repeats: int = 10,
                  max_ops: int | None = None, progress: ProgressFn | None = None, *,
                  device_spec: Device | None = None, seed: int = 0,
                  statistic: Literal["median", "min"] = "median") -> CostTable:
    """Time every distinct node signature of `graph` on `device` ("cpu" or "cuda[:i]"); see the module docstring.

    Nodes without a `sig` are not profiled. Signatures are taken in node order, each once; `max_ops` caps
    how many are run (the rest stay unmeasured and fall back to the analytic model). `progress(done, total,
    target)` is called after each signature. `device_spec` describes the device in the table (and gives its
    kind); by default the local CPU or CUDA device is measured (`local_cpu_device`, `local_cuda_device`).
    `statistic` is what the table keeps of the repeats: the median (default) or the minimum, which
    resists other processes sharing the machine but is optimistic.
    """
    if statistic not in ("median", "min"):
        raise ValueError(f"statistic must be \"median\" or \"min\", got {statistic!r}")
    reduce = statistics.median if statistic == "median" else min
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise CostError(f"can profile on \"cpu\" or \"cuda\", not {str(device)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CostError("profiling on \"cuda\" needs a CUDA GPU, and torch sees none; profile on \"cpu\"")
    spec = device_spec or (local_cpu_device() if dev.type == "cpu" else local_cuda_device(dev.index or 0))

    sigs: dict[str, Mapping[str, Any]] = {}
    for extra in graph.node_extra:
        for sig in node_signatures(extra):  # the op's, then its gradients' adds into .grad and divisions by M
            sigs.setdefault(signature_key(sig), sig)
    keys = list(sigs)
    left_out = 0
    if max_ops is not None and len(keys) > max_ops:
        left_out = len(keys) - max_ops
        keys = keys[:max_ops]

    entries: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for done, key in enumerate(keys, 1):
        sig = sigs[key]
        try:
            func, args, kwargs = decode_signature(sig, dev, seed=seed)
            entries[key] = reduce(time_op(func, args, kwargs, dev, warmup, repeats))
        except Exception as exc:  # every failure is recorded in the table with its reason
            skipped[key] = _reason(exc)
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # after an out-of-memory error, give the cached blocks back
        finally:
            func = args = kwargs = None  # free the tensors before the next signature
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        if progress is not None:
            progress(done, len(keys), str(sig.get("target", "")))
    meta: dict[str, Any] = {"timer": "cuda-events" if dev.type == "cuda" else "perf_counter", "statistic": statistic,
                            "threads": torch.get_num_threads(), "signatures": len(sigs),
                            "not_profiled": left_out}
    return CostTable(device_kind=spec.kind, entries=entries, torch=torch.__version__, warmup=warmup,
                     repeats=repeats, skipped=skipped, device=spec, meta=meta)


# ==================================================================================== calibration
def calibrate(graph: CompGraph, table: CostTable, device_spec: Device | None = None, *,
              roofline: Roofline | None = None) -> dict[str, Any]:
    """Per op class, how far the analytic roofline on `device_spec` is from the measured times in `table`.

    Over the nodes of `graph` whose signature the table holds (one sample per node, so an op that recurs
    counts as often as it runs): `count`, `signatures` (distinct), `profiled_s` and `analytic_s` (sums),
    `ratio` = analytic_s / profiled_s (the error of the total time), `median_rel_error` = median of
    (analytic - profiled) / profiled (bias; > 0 means the model is too slow) and `median_abs_rel_error`
    (spread). Row `"all"` pools every class. `device_spec` defaults to the table's device; `roofline` to
    the one for that device (for the local CPU pass `local_cpu_roofline()` to use the measured overhead).
    """
    spec = device_spec or table.device
    if spec is None:
        raise CostError("calibrate needs the measured device's description: the table has none, pass device_spec")
    rl = roofline or roofline_for(spec)
    samples: dict[str, list[tuple[float, float, str]]] = {}
    uncovered = 0
    for v in range(graph.num_nodes):
        sig = graph.node_extra[v].get("sig") if graph.node_extra else None
        measured = table.lookup(sig)
        if measured is None:
            uncovered += 1
            continue
        rec = graph.node_record(v)
        cls = op_class(graph.op[v], graph.kind[v])
        predicted = analytic_node_time(rec, spec, rl)
        samples.setdefault(cls, []).append((predicted, measured, signature_key(sig)))  # type: ignore[arg-type]

    def row(items: list[tuple[float, float, str]]) -> dict[str, Any]:
        rel = [(a - p) / p for a, p, _ in items if p > 0]
        a_s, p_s = sum(a for a, _, _ in items), sum(p for _, p, _ in items)
        return {"count": len(items), "signatures": len({k for _, _, k in items}), "profiled_s": p_s,
                "analytic_s": a_s, "ratio": a_s / p_s if p_s > 0 else math.nan,
                "median_rel_error": statistics.median(rel) if rel else math.nan,
                "median_abs_rel_error": statistics.median(abs(r) for r in rel) if rel else math.nan}

    order = {c: i for i, c in enumerate(OP_CLASSES)}
    classes = {c: row(samples[c]) for c in sorted(samples, key=lambda c: order.get(c, len(order)))}
    pooled = [s for items in samples.values() for s in items]
    return {"device": spec.kind or spec.name, "roofline": rl.name, "nodes": graph.num_nodes,
            "covered": graph.num_nodes - uncovered, "uncovered": uncovered, "skipped": len(table.skipped),
            "classes": classes, "all": row(pooled)}


def format_calibration(cal: Mapping[str, Any]) -> str:
    """`calibrate`'s result as a plain-text table."""
    lines = [f"analytic ({cal['roofline']}) vs profiled on {cal['device']}: {cal['covered']}/{cal['nodes']} ops "
             f"measured, {cal['skipped']} signatures skipped",
             f"{'op class':<12} {'ops':>6} {'sigs':>5} {'profiled ms':>12} {'analytic ms':>12} {'ratio':>7} "
             f"{'med err':>8} {'med |err|':>9}"]
    rows = [*cal["classes"].items(), ("all", cal["all"])]
    for c, r in rows:
        lines.append(f"{c:<12} {r['count']:>6} {r['signatures']:>5} {r['profiled_s'] * 1e3:>12.3f} "
                     f"{r['analytic_s'] * 1e3:>12.3f} {r['ratio']:>7.2f} {r['median_rel_error']:>+8.0%} "
                     f"{r['median_abs_rel_error']:>9.0%}")
    return "\n".join(lines)


# ==================================================================================== measured training steps
RUN_FORMAT = "devplace.run/1"  # the records `devplace run` appends (written by devplace.runtime.run)


def fold_runs(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Fold `devplace.run/1` records (measured vs simulated step times) into step-time ratios.

    Per cluster device kind (the set of kinds the plan was costed for) and per graph: how many runs, the median
    measured/simulated ratio, and its spread. The ratio is the factor by which the simulation should scale
    its op times for that device kind (>1: the cost model is too fast) -- a coarse, whole-step calibration
    that complements `calibrate`'s per-op one. Records of other formats are ignored and counted.
    """
    by_kind: dict[str, list[float]] = {}
    by_graph: dict[str, list[float]] = {}
    ignored = 0
    for rec in records:
        ratio = rec.get("ratio") if rec.get("format") == RUN_FORMAT else None
        if not isinstance(ratio, int | float) or not math.isfinite(ratio) or ratio <= 0:
            ignored += 1
            continue
        kinds = rec.get("device_kinds") or ["?"]
        by_kind.setdefault(" + ".join(sorted({str(k) for k in kinds})), []).append(float(ratio))
        where = f"{rec.get('graph', '?')} on {rec.get('cluster', '?')} ({','.join(rec.get('devices', []))})"
        by_graph.setdefault(where, []).append(float(ratio))

    def row(values: list[float]) -> dict[str, Any]:
        return {"runs": len(values), "median_ratio": statistics.median(values), "min_ratio": min(values),
                "max_ratio": max(values)}

    return {"runs": sum(len(v) for v in by_kind.values()), "ignored": ignored,
            "device_kinds": {k: row(v) for k, v in sorted(by_kind.items())},
            "graphs": {k: row(v) for k, v in sorted(by_graph.items())}}


def _check_run(rec: Mapping[str, Any], where: str) -> None:
    """Refuse a devplace.run/1 record whose fields `fold_runs` reads have the wrong type (FormatError naming the
    line and the field): the file was edited or damaged."""
    from devplace.errors import FormatError

    for key, test, shape in (("device_kinds", _texts, "a list of texts"), ("devices", _texts, "a list of texts"),
                             ("graph", _text, "a text"), ("cluster", _text, "a text")):
        if key in rec and not test(rec[key]):
            raise FormatError(f"{where}: field {key!r} of the run record must be {shape}, got {rec[key]!r:.60}; the "
                              "record was edited or damaged: remove that line or record the run again")


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _texts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def read_runs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON-lines records of a `devplace run --record` file (blank lines skipped)."""
    from devplace.errors import FormatError
    from devplace.files import parse_json, read_limited

    out: list[dict[str, Any]] = []
    try:
        lines = read_limited(path).decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not UTF-8 text; expected one devplace.run/1 JSON object a line") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = parse_json(line, f"{path}:{i}", "expected one devplace.run/1 object a line")
        if isinstance(rec, dict) and rec.get("format") == RUN_FORMAT:
            _check_run(rec, f"{path}:{i}")
        if isinstance(rec, dict):
            out.append(rec)
    return out


def format_runs(folded: Mapping[str, Any]) -> str:
    """`fold_runs`'s result as a plain-text table."""
    lines = [f"{folded['runs']} measured runs ({folded['ignored']} records ignored): measured / simulated step time"]
    for title, key in (("device kinds", "device_kinds"), ("graph on cluster (devices)", "graphs")):
        lines.append(f"{title:<48} {'runs':>5} {'median':>8} {'min':>8} {'max':>8}")
        for name, r in folded[key].items():
            lines.append(f"{name[:48]:<48} {r['runs']:>5} {r['median_ratio']:>8.3f} {r['min_ratio']:>8.3f} "
                         f"{r['max_ratio']:>8.3f}")
    return "\n".join(lines)
