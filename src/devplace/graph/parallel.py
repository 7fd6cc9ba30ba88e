"""`ParallelPlan`: how a training step runs on many devices (DESIGN.md section 9b), as a validated value with
its JSON form. `dp` replicas of a pipeline of `pp` stages, `microbatches` M per replica, a pipeline schedule,
and per stage a ZeRO stage (over that stage's replicas) and a recomputation choice: "none", "full", or an
integer k, recompute the stage's first k blocks (numbered blocks, `graph.modules.numbered_block`: transformer
layers; 0 is "none", and k = the stage's block count recomputes as "full" does).

Devices form a mesh of shape (dp, pp, tp), stored row-major as one flat tuple (`devices`), as torch's
`DeviceMesh` does: replica r of stage s (tensor-parallel rank t) runs on `devices[(r * pp + s) * tp + t]`.
A tensor-parallel degree `tp` is part of the format already; only tp = 1 is accepted until tensor
parallelism is built, so adding it changes no key. Which ops form each stage (the cuts) is a placement of one
replica's graph; the plan says where the stages and their replicas run.

Pipeline schedules (`SCHEDULES`): "none" (one stage: the M micro-batches run one after another, gradient
accumulation), the `Schedule` kinds GPipe, 1F1B and interleaved 1F1B (`chunks` V >= 2), and the zero-bubble
schedules torch runs: interleaved zero bubble ("zero-bubble", V >= 2 chunks per device), ZBV and DualPipeV
(two chunks per device in a V shape).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devplace.defaults import MAX_MICROBATCHES
from devplace.errors import DevplaceError
from devplace.graph.schedule import V_SHAPED, Schedule, stage_position

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
MULTI_CHUNK = ("interleaved-1f1b", "zero-bubble", *V_SHAPED)  # kinds that may run several chunks per device
RECOMPUTE = ("none", "full")  # the named recomputation choices; an integer k (a number of blocks) is the third
ZERO_STAGES = (0, 1, 2, 3)
KEYS = ("dp", "pp", "tp", "microbatches", "batch", "schedule", "chunks", "zero", "recompute", "devices")


class ParallelPlanError(DevplaceError):
    """An invalid parallel plan: degrees, batch split, schedule, per-stage choices or device mesh."""


def _recompute(value: object) -> str | int:
    """One stage's recomputation choice: "none", "full" or a number of blocks k >= 1 (0 is "none")."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value) if value else "none"
    if value not in RECOMPUTE:
        raise ParallelPlanError(f"parallel plan: recompute must be one of {', '.join(RECOMPUTE)} or a number of "
                                f"blocks (an integer >= 0) per stage, got {value!r}")
    return str(value)


def _count(value: object, name: str, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ParallelPlanError(f"parallel plan: {name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ParallelPlanError(f"parallel plan: {name} must be at most {high:,}, got {value:,}")
    return int(value)


def _per_stage(value: object, pp: int, name: str) -> tuple[Any, ...]:
    """A per-stage choice: one value for every stage, or a list of `pp` values."""
    if isinstance(value, tuple | list):
        if len(value) != pp:
            raise ParallelPlanError(f"parallel plan: {name} lists {len(value)} values for {pp} stages; give one "
                                    "per stage (or a single value for all)")
        return tuple(value)
    return (value,) * pp


@dataclass(frozen=True)
class ParallelPlan:
    """A dp x pp (x tp) plan for a global `batch` (see the module docstring). Every field is checked when the
    plan is made: M divides batch / dp, the schedule suits pp and `chunks`, `zero` and `recompute` hold one
    value per stage (a single value is broadcast), `devices` lists dp * pp * tp distinct device indices
    (default: stage s's replicas on consecutive devices, so a stage's data-parallel group shares a node)."""

    dp: int
    pp: int
    microbatches: int
    batch: int
    schedule: str = "1f1b"
    chunks: int | None = None
    zero: tuple[int, ...] | int = 0
    recompute: tuple[str | int, ...] | str | int = "none"
    devices: tuple[int, ...] | None = None
    tp: int = 1

    def __post_init__(self) -> None:
        dp, pp = _count(self.dp, "dp"), _count(self.pp, "pp")
        tp = _count(self.tp, "tp")
        if tp != 1:
            raise ParallelPlanError(f"parallel plan: tensor parallelism is not built yet, got tp={tp}; use tp=1")
        m = _count(self.microbatches, "microbatches", 1, MAX_MICROBATCHES)
        batch = _count(self.batch, "batch")
        if batch % dp:
            raise ParallelPlanError(f"parallel plan: dp={dp} replicas do not split the batch of {batch} evenly; "
                                    "use a dp that divides the batch")
        if (batch // dp) % m:
            raise ParallelPlanError(f"parallel plan: M={m} micro-batches do not split a replica's batch of "
                                    f"{batch // dp} (batch {batch} / dp {dp}) evenly; use an M that divides "
                                    f"{batch // dp}")
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp), ("microbatches", m), ("batch", batch)):
            object.__setattr__(self, name, value)
        self._check_schedule()
        zero = _per_stage(self.zero, pp, "zero")
        for z in zero:
            if isinstance(z, bool) or z not in ZERO_STAGES:
                raise ParallelPlanError(f"parallel plan: zero must be one of 0, 1, 2, 3 per stage, got {z!r}")
            if z and dp == 1:
                raise ParallelPlanError(f"parallel plan: ZeRO-{z} shards over a stage's data-parallel replicas, "
                                        "and dp=1 has none to shard over; use zero=0 or dp >= 2")
        object.__setattr__(self, "zero", tuple(int(z) for z in zero))
        recompute = tuple(_recompute(r) for r in _per_stage(self.recompute, pp, "recompute"))
        object.__setattr__(self, "recompute", recompute)
        n = dp * pp * tp
        if self.devices is None:  # stage s's replicas on devices s*dp .. s*dp + dp - 1
            devices = tuple(s * dp + r for r in range(dp) for s in range(pp))
        else:
            devices = self.devices
            ok = (isinstance(devices, tuple | list) and len(devices) == n and len(set(devices)) == n
                  and all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in devices))
            if not ok:
                raise ParallelPlanError(f"parallel plan: devices must list dp*pp*tp = {n} distinct device indices "
                                        f"(mesh (dp, pp, tp), row-major), got {devices!r}")
        object.__setattr__(self, "devices", tuple(int(d) for d in devices))

    def _check_schedule(self) -> None:
        kind, pp, m = self.schedule, self.pp, self.microbatches
        if kind not in SCHEDULES:
            raise ParallelPlanError(f"parallel plan: unknown schedule {kind!r}; choose one of: {', '.join(SCHEDULES)}")
        if (kind == "none") != (pp == 1):
            raise ParallelPlanError(f"parallel plan: schedule {kind!r} with pp={pp}; one stage runs schedule "
                                    "'none' (micro-batches one after another), a pipeline of several stages any "
                                    "other")
        default = 2 if kind in MULTI_CHUNK else 1
        chunks = default if self.chunks is None else _count(self.chunks, "chunks")
        if kind in V_SHAPED and chunks != 2:
            raise ParallelPlanError(f"parallel plan: {kind} runs two chunks per device (a V), got chunks={chunks}")
        if kind in ("interleaved-1f1b", *V_SHAPED) and chunks < 2:
            raise ParallelPlanError(f"parallel plan: {kind} needs chunks >= 2 per device, got {chunks}; with one "
                                    "chunk per device use '1f1b'")
        if kind not in MULTI_CHUNK and chunks != 1:
            raise ParallelPlanError(f"parallel plan: {kind} runs one chunk per device, got chunks={chunks}")
        if kind == "interleaved-1f1b" and m % pp:
            raise ParallelPlanError(f"parallel plan: {kind} runs micro-batches in rounds of pp={pp}, got M={m}; "
                                    f"use a multiple of {pp}")
        rounds = max(1, m // pp)
        if kind == "zero-bubble" and m % rounds:
            raise ParallelPlanError(f"parallel plan: zero-bubble runs M={m} micro-batches in {rounds} equal rounds "
                                    f"(torch's rule: M // pp of them), which {m} does not split; use a multiple of "
                                    f"{pp} or an M below {pp}")
        if kind == "dualpipev" and m < 2 * pp:
            raise ParallelPlanError(f"parallel plan: dualpipev runs at least as many micro-batches as stages (2 per "
                                    f"device: {2 * pp}), got M={m}; use M >= {2 * pp} or zbv")
        object.__setattr__(self, "chunks", chunks)

    def check_blocks(self, blocks: tuple[int, ...]) -> None:
        """ParallelPlanError where a stage recomputes more blocks than it has; `blocks[s]` is the number of
        numbered blocks on device position s (known once the stages are cut)."""
        for s, (r, n) in enumerate(zip(self.recompute, blocks, strict=True)):
            if isinstance(r, int) and r > n:
                raise ParallelPlanError(f"parallel plan: stage {s} recomputes {r} blocks but holds {n}; give at "
                                        f"most {n} (or \"full\")")

    @property
    def recomputes(self) -> bool:
        """Whether any stage recomputes (some blocks, or all)."""
        return any(r != "none" for r in self.recompute)

    @property
    def num_devices(self) -> int:
        """dp * pp * tp: the devices the plan uses."""
        return self.dp * self.pp * self.tp

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch: batch / dp / M."""
        return self.batch // self.dp // self.microbatches

    def replica(self, r: int) -> tuple[int, ...]:
        """The devices of replica r, stage 0's first (its pipeline's device order)."""
        return tuple(self.devices[(r * self.pp + s) * self.tp] for s in range(self.pp))

    def stage_group(self, s: int) -> tuple[int, ...]:
        """The data-parallel group of stage s: its replicas' devices, replica 0's first."""
        return tuple(self.devices[(r * self.pp + s) * self.tp] for r in range(self.dp))

    def pipeline_schedule(self, replica: int = 0, microbatch_graph: bool = False) -> Schedule:
        """The `Schedule` one replica's pipeline runs ("none": 1F1B on one device, which runs each micro-batch's
        forward then its backward)."""
        kind = "1f1b" if self.schedule == "none" else self.schedule
        return Schedule(kind, self.microbatches, self.chunks, microbatch_graph, self.replica(replica))

    @property
    def label(self) -> str:
        """Short form for reports: "dp=2 pp=4 1f1b M=8 zero=1 recompute=full"."""
        def one(values: tuple[Any, ...]) -> str:
            return str(values[0]) if len(set(values)) == 1 else ",".join(map(str, values))
        chunks = f" V={self.chunks}" if (self.chunks or 1) > 1 else ""
        return (f"dp={self.dp} pp={self.pp} {self.schedule} M={self.microbatches}{chunks} "
                f"zero={one(self.zero)} recompute={one(self.recompute)}")

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON form (the "parallel" object of a placement or a `--json` answer)."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "microbatches": self.microbatches, "batch": self.batch,
                "schedule": self.schedule, "chunks": self.chunks, "zero": list(self.zero),
                "recompute": list(self.recompute), "devices": list(self.devices or ())}

    @classmethod
    def from_dict(cls, doc: Any) -> ParallelPlan:
        """The plan of a `to_dict()` document; ParallelPlanError for anything else (unknown keys included)."""
        required = ("dp", "pp", "microbatches", "batch")
        if not isinstance(doc, dict) or set(doc) - set(KEYS) or any(k not in doc for k in required):
            raise ParallelPlanError(f"a parallel plan is an object with keys {', '.join(KEYS)} ("
                                    f"{', '.join(required)} required), got {doc!r}")
        doc = dict(doc)
        for key in ("zero", "recompute", "devices"):
            if isinstance(doc.get(key), list):
                doc[key] = tuple(doc[key])
        return cls(**doc)


RECOMPUTE_ASKS = (*RECOMPUTE, "auto")


@dataclass(frozen=True)
class ParallelAsk:
    """What a request fixes of a parallel plan (`devplace place --dp/--pp/--zero/--recompute`, `--parallel`):
    each dimension None (or recompute "auto") is searched, any other value is the only one tried. Checked when
    made; whether dp x pp matches a cluster and the batch is the search's check (it knows them)."""

    dp: int | None = None
    pp: int | None = None
    zero: int | None = None
    recompute: str = "auto"

    def __post_init__(self) -> None:
        for name in ("dp", "pp"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _count(value, name))
        if self.zero is not None and (isinstance(self.zero, bool) or self.zero not in ZERO_STAGES):
            raise ParallelPlanError(f"--zero must be one of 0, 1, 2, 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE_ASKS:
            raise ParallelPlanError(f"--recompute must be one of {', '.join(RECOMPUTE_ASKS)}, got {self.recompute!r}")
        if self.dp == 1 and self.zero:
            raise ParallelPlanError(f"--zero {self.zero} shards over a stage's data-parallel replicas, and --dp 1 has "
                                    "none to shard over; use --zero 0 or --dp >= 2")

    def check_devices(self, devices: int) -> None:
        """ParallelPlanError where the fixed dp and pp do not fit `devices` (a plan uses every device: dp x pp =
        devices), naming what would."""
        divisors = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
        if self.dp is not None and self.pp is not None and self.dp * self.pp != devices:
            raise ParallelPlanError(f"--dp {self.dp} x --pp {self.pp} = {self.dp * self.pp} devices, and the cluster "
                                    f"has {devices}: a plan uses every device; give dp and pp whose product is "
                                    f"{devices}")
        for name, value in (("--dp", self.dp), ("--pp", self.pp)):
            if value is not None and devices % value:
                raise ParallelPlanError(f"{name} {value} does not divide the cluster's {devices} devices (a plan uses "
                                        f"every device: dp x pp = {devices}); use one of {divisors}")
        if self.pp == devices and self.zero:
            raise ParallelPlanError(f"--zero {self.zero} shards over a stage's data-parallel replicas, and --pp "
                                    f"{devices} leaves dp = 1, none to shard over; use --zero 0 or fewer stages")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: each dimension's fixed value, or "auto"."""
        return {"dp": self.dp or "auto", "pp": self.pp or "auto",
                "zero": "auto" if self.zero is None else self.zero, "recompute": self.recompute}

    @classmethod
    def from_dict(cls, doc: Any) -> ParallelAsk:
        """The ask of a `to_dict()` document (a recorded request's); ParallelPlanError for one that is not."""
        if not isinstance(doc, Mapping) or set(doc) - {"dp", "pp", "zero", "recompute"}:
            raise ParallelPlanError(f"a parallel ask records dp, pp, zero and recompute, got {doc!r:.120}")
        dims = {k: None if doc.get(k) == "auto" else doc.get(k) for k in ("dp", "pp", "zero")}
        return cls(**dims, recompute=doc.get("recompute", "auto"))


# the pipeline schedules devplace's runtime runs a parallel plan under (`runtime.parallel_run.SCHEDULES`, which
# graph/ may not import; tests/test_parallel_search.py checks the two agree); zero-bubble with one chunk (ZB-H1),
# zbv and dualpipev with their two in a V
RUN_SCHEDULES = ("gpipe", "1f1b", "zero-bubble", *V_SHAPED)


def runtime_gap(plan: ParallelPlan) -> str | None:
    """What of `plan` devplace's runtime does not run, or None when it runs all of it: `devplace run` runs dp
    replicas of one pipeline under one of `RUN_SCHEDULES` (or of one stage), one stage per process (two in a V),
    with ZeRO 0-3 and recomputation per stage (`runtime.parallel_run`); other schedules not yet, and not ZeRO-3
    under a zero-bubble schedule (zero-bubble, zbv, dualpipev): torch's split backward of a stage that
    `fully_shard` reshards after forward gives wrong gradients (measured on a 2 x 2 ZB-H1 plan: the ZeRO-3
    stage's gradients differ from the one-process step; ZeRO 0-2 match)."""
    if plan.schedule not in ("none", *RUN_SCHEDULES):
        return f"the {plan.schedule} schedule"
    parallel = plan.dp > 1 or max(plan.zero) > 0 or plan.recomputes  # else it runs as a pipeline
    if parallel and plan.chunks != 1 and plan.schedule not in V_SHAPED:
        return f"{plan.chunks} chunks per device (a dp x pp run runs one stage per process, or two in a V)"
    if plan.schedule in ("zero-bubble", *V_SHAPED) and 3 in plan.zero:
        return f"ZeRO-3 under the {plan.schedule} schedule"
    return None


# ------------------------------------------------------------------------------------- the stage cut, recorded
STAGES_KEY = "stages"  # the key of a parallel plan's placement (beside "parallel") that records each op's stage


def stages_record(ids: Sequence[str], stage: Sequence[int] | Any) -> dict[str, int]:
    """The JSON record of a plan's stage cut: each op id's pipeline stage (0..pp V - 1, in the order data flows:
    under a V, stage k runs on position k on the way out and 2 pp - 1 - k on the way back,
    `graph.schedule.stage_position`). A placement of replica 0 says which device runs each op; at a V's turn two
    stages share a device, so only this record tells them apart. It does not depend on the mesh: a later
    tensor-parallel degree splits each stage over its tp ranks (`ParallelPlan.devices`) and keeps the record."""
    return {i: int(s) for i, s in zip(ids, stage, strict=True)}


def recorded_stages(plan: ParallelPlan, ids: Sequence[str], assignment: Mapping[str, int],
                    record: object) -> list[int]:
    """Each op's stage (in the order of `ids`) of a saved plan: its `stages_record` where the placement has one
    (checked: one stage 0..pp V - 1 per op, each op on the device of replica 0 its stage's position runs on,
    `assignment`), else, for a plan of one chunk per device (a file written before the record), its device's
    position in replica 0. ParallelPlanError saying what is wrong and how to fix it."""
    k = plan.pp * int(plan.chunks or 1)
    replica = plan.replica(0)
    if record is None:
        if k != plan.pp:
            raise ParallelPlanError(f"the placement of the {plan.schedule} plan {plan.label} records no \"stages\": "
                                    f"{k} stages on {plan.pp} devices cannot be read off its devices; place it again")
        where = {d: s for s, d in enumerate(replica)}
        bad = next((i for i in ids if assignment.get(i) not in where), None)
        if bad is not None:
            raise ParallelPlanError(f"the placement puts op {bad!r} on device {assignment.get(bad)!r}, not one of the "
                                    f"plan's replica 0 devices {list(replica)}; place it again")
        return [where[assignment[i]] for i in ids]
    if not isinstance(record, Mapping) or set(record) != set(ids):
        raise ParallelPlanError(f"the placement's \"stages\" must give each of the graph's {len(ids)} ops its "
                                "pipeline stage (an object op id -> stage); place it again")
    out = []
    for i in ids:
        s = record[i]
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < k:
            raise ParallelPlanError(f"the placement's \"stages\" gives op {i!r} stage {s!r}; the plan "
                                    f"({plan.label}) has stages 0..{k - 1}")
        device = replica[stage_position(plan.schedule, int(s), plan.pp)]
        if assignment.get(i) != device:
            raise ParallelPlanError(f"the placement puts op {i!r} on device {assignment.get(i)!r}, but its stage "
                                    f"{s} runs on device {device} ({plan.label}); the two were edited apart: place "
                                    "it again")
        out.append(int(s))
    return out
