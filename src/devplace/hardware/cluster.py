"""Devices, links and clusters, and the `devplace.cluster/1` format."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from devplace.defaults import MAX_DEVICES
from devplace.errors import ClusterError
from devplace.graph.compgraph import MAX_TOTAL, CompGraph, check_name
from devplace.graph.jsonio import check_format, dump_number, read_json, write_json
from devplace.graph.phases import step_compute

FORMAT = "devplace.cluster/1"
# Dense peak FLOP/s per precision class (docs/clusters.md, "Peak FLOP/s per precision"); 0 = unknown.
PRECISION_PEAK_KEYS = ("peak_flops_fp32", "peak_flops_tf32", "peak_flops_bf16", "peak_flops_fp16")
DEVICE_KEYS = ("name", "memory_bytes", "speed", "peak_flops", "mem_bandwidth_Bps", "kind", *PRECISION_PEAK_KEYS,
               "action_s")


@dataclass(frozen=True)
class Device:
    """One accelerator. `speed` scales every op's `compute_s`; `peak_flops` (dense FLOP/s at the precision
    of mixed-precision training) and `mem_bandwidth_Bps` feed the analytic cost model.

    The `peak_flops_*` fields are the dense peaks per precision class, for the matrix products of ops in that
    precision: `fp32` on the CUDA cores, `tf32` (fp32 ops allowed to use TF32 tensor cores), `bf16` and
    `fp16` (tensor cores where the GPU has them). 0 means unknown: the cost model then uses `peak_flops`,
    as it did for every op before these fields existed (docs/cost-models.md, "Precision").

    `action_s` is what the pipelining runtime spends on this device per action of a pipelined step (one stage's
    forward or backward of one micro-batch: receiving, sending, scheduling), beyond the action's ops; a
    micro-batch schedule's simulation charges it once per action (`devplace.sim.schedule`). 0 = not measured
    (`devplace profile` measures it on this machine: `hardware.cost.Overheads`)."""

    name: str
    memory_bytes: float
    speed: float = 1.0
    peak_flops: float = 0.0
    mem_bandwidth_Bps: float = 0.0
    kind: str = ""
    peak_flops_fp32: float = 0.0
    peak_flops_tf32: float = 0.0
    peak_flops_bf16: float = 0.0
    peak_flops_fp16: float = 0.0
    action_s: float = 0.0


@dataclass(frozen=True)
class Link:
    """A directed device-to-device channel: a transfer of b bytes takes latency_s + b / bandwidth_Bps."""

    bandwidth_Bps: float
    latency_s: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices plus a default link for every ordered pair and per-pair overrides (`links`)."""

    name: str
    devices: tuple[Device, ...]
    link: Link
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # read-only copies: the bandwidth/latency matrices below are derived once, so `links` must not change after
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))
        n = len(self.devices)
        if n == 0:
            raise ClusterError(f"cluster {self.name!r} has no devices; list at least one under \"devices\"")
        for a, b in self.links:  # from_dict checks these too; this guards clusters built in Python
            for end in (a, b):
                if isinstance(end, bool) or not isinstance(end, int | np.integer) or not 0 <= end < n:
                    raise ClusterError(f"cluster {self.name!r}: link {a!r} -> {b!r} names no device; device "
                                       f"indices are 0..{n - 1}")
            if a == b:
                raise ClusterError(f"cluster {self.name!r}: link {a} -> {b} joins a device to itself; links "
                                   "join two different devices")
        # from_dict checks the numbers with the file's positions; this guards clusters built in Python: with
        # rates in [1 / MAX_TOTAL, MAX_TOTAL] and finite latencies, step times of valid graphs stay finite
        for i, d in enumerate(self.devices):
            _check_rate(d.speed, f"cluster {self.name!r}: device #{i} speed")
            if not (isinstance(d.action_s, int | float) and 0 <= d.action_s <= MAX_TOTAL):
                raise ClusterError(f"cluster {self.name!r}: device #{i} action_s is {d.action_s!r}; it must be a "
                                   f"number of seconds in 0..{MAX_TOTAL:.0e}")
        for key, lk in [("link", self.link), *((f"link {a} -> {b}", v) for (a, b), v in self.links.items())]:
            _check_rate(lk.bandwidth_Bps, f"cluster {self.name!r}: {key} bandwidth_Bps")
            if not (isinstance(lk.latency_s, int | float) and 0 <= lk.latency_s <= MAX_TOTAL):
                raise ClusterError(f"cluster {self.name!r}: {key} latency_s is {lk.latency_s!r}; it must be a "
                                   f"number of seconds in 0..{MAX_TOTAL:.0e}")
        bw = np.full((n, n), self.link.bandwidth_Bps, dtype=np.float64)
        lat = np.full((n, n), self.link.latency_s, dtype=np.float64)
        for (a, b), lk in self.links.items():
            bw[a, b], lat[a, b] = lk.bandwidth_Bps, lk.latency_s
        np.fill_diagonal(bw, np.inf)
        np.fill_diagonal(lat, 0.0)
        for arr in (bw, lat):
            arr.setflags(write=False)
        object.__setattr__(self, "bandwidth", bw)
        object.__setattr__(self, "latency", lat)

    bandwidth: np.ndarray = field(init=False, repr=False)  # [D, D] bytes/s, inf on the diagonal
    latency: np.ndarray = field(init=False, repr=False)  # [D, D] seconds, 0 on the diagonal

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt through the constructor: mapping proxies do not pickle (process pools and Ray send clusters)
        return (Cluster, (self.name, self.devices, self.link, dict(self.links), dict(self.meta)))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def speeds(self) -> np.ndarray:
        return np.array([d.speed for d in self.devices], dtype=np.float64)

    @property
    def memory(self) -> np.ndarray:
        return np.array([d.memory_bytes for d in self.devices], dtype=np.float64)

    def pair(self, a: int, b: int) -> Link:
        """The link used for transfers from device a to device b (a != b)."""
        return self.links.get((a, b), self.link)

    def to_dict(self) -> dict[str, Any]:
        """The cluster as a `devplace.cluster/1` document."""
        devs = []
        for d in self.devices:
            rec: dict[str, Any] = {"name": d.name, "memory_bytes": dump_number(d.memory_bytes),
                                   "speed": dump_number(d.speed)}
            for k in ("peak_flops", "mem_bandwidth_Bps", *PRECISION_PEAK_KEYS, "action_s"):
                if getattr(d, k):
                    rec[k] = dump_number(getattr(d, k))
            if d.kind:
                rec["kind"] = d.kind
            devs.append(rec)
        doc: dict[str, Any] = {"format": FORMAT, "name": self.name, **self.meta, "devices": devs,
                               "link": _link_dict(self.link)}
        if self.links:
            doc["links"] = [{"src": a, "dst": b, **_link_dict(lk)} for (a, b), lk in sorted(self.links.items())]
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str = "cluster") -> Cluster:
        """Validate and build a cluster from a `devplace.cluster/1` document.

        Numbers must be finite; rates (speed, bandwidth_Bps, and peak_flops, mem_bandwidth_Bps when not 0)
        at least 1 / MAX_TOTAL and every number at most MAX_TOTAL (1e100), so that step times, sums of graph
        totals divided by rates, stay finite. Names are at most MAX_NAME_CHARS characters.
        """
        check_format(doc, FORMAT, where)
        name = doc.get("name", "")
        if not isinstance(name, str):
            raise ClusterError(f"{where}: \"name\" must be a string")
        try:
            check_name(name, "cluster", ClusterError)
        except ClusterError as exc:
            raise ClusterError(f"{where}: {exc}") from None
        raw_devs = doc.get("devices")
        if not isinstance(raw_devs, list) or not raw_devs:
            raise ClusterError(f"{where}: \"devices\" must be a non-empty list of devices")
        if len(raw_devs) > MAX_DEVICES:
            raise ClusterError(f"{where}: {len(raw_devs):,} devices, more than the limit of {MAX_DEVICES:,}")
        devices = []
        for i, rec in enumerate(raw_devs):
            at = f"{where}: device #{i}"
            if not isinstance(rec, Mapping):
                raise ClusterError(f"{at} must be an object")
            _known_keys(rec, DEVICE_KEYS, at)
            if "memory_bytes" not in rec:
                raise ClusterError(f"{at} needs \"memory_bytes\"")
            kind = rec.get("kind", "")
            if not isinstance(kind, str):
                raise ClusterError(f"{at}: \"kind\" must be a string")
            dev_name = str(rec.get("name", f"gpu{i}"))
            try:
                check_name(dev_name, "device", ClusterError)
            except ClusterError as exc:
                raise ClusterError(f"{at}: {exc}") from None
            devices.append(Device(
                name=dev_name,
                memory_bytes=_positive(rec["memory_bytes"], f"{at}: \"memory_bytes\""),
                speed=_positive(rec.get("speed", 1.0), f"{at}: \"speed\"", rate=True),
                peak_flops=_positive(rec.get("peak_flops", 0.0), f"{at}: \"peak_flops\"", allow_zero=True,
                                     rate=True),
                mem_bandwidth_Bps=_positive(rec.get("mem_bandwidth_Bps", 0.0), f"{at}: \"mem_bandwidth_Bps\"",
                                            allow_zero=True, rate=True),
                kind=kind,
                **{k: _positive(rec.get(k, 0.0), f"{at}: \"{k}\"", allow_zero=True) for k in PRECISION_PEAK_KEYS},
                action_s=_positive(rec.get("action_s", 0.0), f"{at}: \"action_s\"", allow_zero=True),
            ))
        if "link" not in doc:
            raise ClusterError(f"{where}: needs a default \"link\" with bandwidth_Bps and latency_s")
        link = _parse_link(doc["link"], f"{where}: \"link\"")
        links: dict[tuple[int, int], Link] = {}
        raw_links = doc.get("links", [])
        if not isinstance(raw_links, list):
            raise ClusterError(f"{where}: \"links\" must be a list")
        for j, rec in enumerate(raw_links):
            at = f"{where}: links[{j}]"
            if not isinstance(rec, Mapping):
                raise ClusterError(f"{at} must be an object")
            a, b = rec.get("src"), rec.get("dst")
            for end in (a, b):
                if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end < len(devices):
                    raise ClusterError(f"{at}: src and dst must be device indices 0..{len(devices) - 1}, got "
                                       f"{a!r} -> {b!r}")
            if a == b:
                raise ClusterError(f"{at}: src and dst are both {a}; links join two different devices")
            if (a, b) in links:
                raise ClusterError(f"{at}: second entry for link {a} -> {b}; give each directed pair once")
            links[(a, b)] = _parse_link(rec, at, ("src", "dst", "bandwidth_Bps", "latency_s"))
        total_memory = math.fsum(d.memory_bytes for d in devices)
        if total_memory > MAX_TOTAL:
            raise ClusterError(f"{where}: the devices' memory_bytes sum to {total_memory:.3g}, above the limit of "
                               f"{MAX_TOTAL:.0e}; check the units (bytes)")
        meta = {k: v for k, v in doc.items() if k not in ("format", "name", "devices", "link", "links")}
        return cls(name=name, devices=tuple(devices), link=link, links=links, meta=meta)


def _positive(value: Any, where: str, allow_zero: bool = False, rate: bool = False) -> float:
    """A finite number > 0 (>= 0 with `allow_zero`) and at most MAX_TOTAL; a `rate` (a divisor of step
    times) that is not 0 must also be at least 1 / MAX_TOTAL."""
    try:
        finite = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise ClusterError(f"{where} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ClusterError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    if value > MAX_TOTAL or (rate and 0 < value < 1 / MAX_TOTAL):
        low = f"{1 / MAX_TOTAL:.0e}" if rate else "0"
        raise ClusterError(f"{where} is {value!r}, outside {low}..{MAX_TOTAL:.0e}; check its units")
    return float(value)


def _check_rate(value: Any, where: str) -> None:
    """A speed or bandwidth: a number in [1 / MAX_TOTAL, MAX_TOTAL] (so no step time overflows)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 / MAX_TOTAL <= value <= MAX_TOTAL:
        raise ClusterError(f"{where} is {value!r}; it must be a number in {1 / MAX_TOTAL:.0e}..{MAX_TOTAL:.0e}")


def _known_keys(rec: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """Refuse unknown keys: a typo such as "sped" would otherwise silently leave a default in place."""
    for key in rec:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ClusterError(f"{where}: unknown key {key!r}; {hint}known keys: {', '.join(known)}")


def _parse_link(rec: Any, where: str, known: tuple[str, ...] = ("bandwidth_Bps", "latency_s")) -> Link:
    if not isinstance(rec, Mapping) or "bandwidth_Bps" not in rec:
        raise ClusterError(f"{where} needs \"bandwidth_Bps\" (and optionally \"latency_s\")")
    _known_keys(rec, known, where)
    return Link(bandwidth_Bps=_positive(rec["bandwidth_Bps"], f"{where}: \"bandwidth_Bps\"", rate=True),
                latency_s=_positive(rec.get("latency_s", 0.0), f"{where}: \"latency_s\"", allow_zero=True))


def op_times(graph: CompGraph, cluster: Cluster) -> np.ndarray:
    """float64[V, D]: every op's seconds on every device. A device of a kind the graph was costed for
    (`graph.kind_compute`, written per kind by the cost model for a cluster of several kinds) takes that kind's
    time; any other device compute_s / speed (DESIGN.md section 4, rule 1)."""
    return _times(graph.compute_s, graph.kind_compute, cluster)


def step_times(graph: CompGraph, cluster: Cluster) -> np.ndarray:
    """float64[V, D]: the part of `op_times` that runs once per step under a micro-batch schedule (an optimizer
    update, alone or merged into a coarse group or tie class: `devplace.graph.phases`); the rest runs once per
    micro-batch."""
    step = step_compute(graph)
    return _times(step.compute_s, step.by_kind, cluster)


def _times(compute_s: np.ndarray, by_kind: Mapping[str, np.ndarray], cluster: Cluster) -> np.ndarray:
    cols = [by_kind[d.kind] if d.kind in by_kind else compute_s / d.speed for d in cluster.devices]
    return np.ascontiguousarray(np.stack(cols, axis=1), dtype=np.float64)


def effective_speeds(graph: CompGraph, cluster: Cluster) -> np.ndarray:
    """Per device, the speed at which it runs this graph's whole compute: its `speed`, or, where the graph was
    costed for the device's kind, sum(compute_s) / (its seconds for every op) -- for heuristics that balance
    compute against one speed per device."""
    if not any(d.kind in graph.kind_compute for d in cluster.devices):
        return cluster.speeds
    total = op_times(graph, cluster).sum(axis=0)
    return np.where(total > 0, float(graph.compute_s.sum()) / np.where(total > 0, total, 1.0), cluster.speeds)


def canonical_order(graph: CompGraph, cluster: Cluster) -> np.ndarray:
    """The cluster's devices in an order that does not depend on how its file lists them: fastest first for
    `graph` (its ops' total seconds on the device, `op_times`), then the most memory, then the fastest links
    (the least total latency-plus-transfer time of a byte to and from the others), then as listed (devices
    that tie on all of these are interchangeable). perm[i] is the index, in `cluster`, of device i of the
    canonical order."""
    total = op_times(graph, cluster).sum(axis=0)
    off = ~np.eye(cluster.num_devices, dtype=bool)
    per_byte = np.where(off, 1.0 / cluster.bandwidth + cluster.latency, 0.0)
    links = per_byte.sum(axis=0) + per_byte.sum(axis=1)
    return np.lexsort((np.arange(cluster.num_devices), links, -cluster.memory, total)).astype(np.int64)


def reordered(cluster: Cluster, perm: np.ndarray) -> Cluster:
    """`cluster` with device i being its device perm[i] (its per-pair links renumbered alike)."""
    inverse = np.empty(len(perm), dtype=np.int64)
    inverse[perm] = np.arange(len(perm))
    links = {(int(inverse[a]), int(inverse[b])): lk for (a, b), lk in cluster.links.items()}
    return Cluster(cluster.name, tuple(cluster.devices[int(d)] for d in perm), cluster.link, links,
                   dict(cluster.meta))


def _link_dict(lk: Link) -> dict[str, Any]:
    return {"bandwidth_Bps": dump_number(lk.bandwidth_Bps), "latency_s": dump_number(lk.latency_s)}


def load_cluster(name_or_path: str | Path, *, max_bytes: int | None = None) -> Cluster:
    """A preset by name (see `devplace clusters`) or a `devplace.cluster/1` file (refused when longer than
    the input limit: `max_bytes`, default DEVPLACE_MAX_INPUT_BYTES or 256 MiB)."""
    from devplace.hardware.presets import PRESETS

    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]()
    path = Path(key)
    if not key or not path.exists():  # "" would be read as the folder "."
        raise ClusterError(f"{key!r} is neither a cluster preset nor a file; presets: {', '.join(PRESETS)}")
    doc = read_json(path, FORMAT, max_bytes=max_bytes)
    return Cluster.from_dict(doc, str(path))


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write `cluster` as `devplace.cluster/1`."""
    write_json(path, cluster.to_dict())
