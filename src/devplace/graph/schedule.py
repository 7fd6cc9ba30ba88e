"""`Schedule`: a micro-batch pipeline schedule as a value (kind, micro-batches, chunks, device order), validated,
with its JSON form. A `Placement` made for a schedule carries one; compiling and simulating schedules is
`devplace.sim.schedule`'s (which re-exports these names)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from devplace.defaults import MAX_CHUNKS, MAX_MICROBATCHES
from devplace.errors import DevplaceError

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two chunks per device in a V: device r runs stages r and 2p - 1 - r
MULTI_CHUNK = ("interleaved-1f1b", *V_SHAPED)  # kinds that need (or, V-shaped, have exactly) two or more chunks


def stage_position(kind: str, stage: int, positions: int) -> int:
    """The pipeline position (device, or process) of pipeline stage `stage` of a pipeline of `positions` under
    schedule `kind`: stage mod p, round the positions (one or several chunks each), or, V-shaped (zbv, dualpipev),
    stage s < p at position s and s >= p at 2p - 1 - s (torch's `generate_stage_to_rank_mapping(style="v")`)."""
    if kind in V_SHAPED:
        return stage if stage < positions else 2 * positions - 1 - stage
    return stage % positions


def chunk_stage(kind: str, chunk: int, position: int, positions: int) -> int:
    """The pipeline stage that pipeline position `position` of `positions` runs as its chunk `chunk` under
    schedule `kind` (the inverse of `stage_position`): chunk * p + position, or, V-shaped, `position` on the way
    out and 2p - 1 - position on the way back."""
    if kind in V_SHAPED:
        return position if chunk == 0 else 2 * positions - 1 - position
    return chunk * positions + position


class ScheduleError(DevplaceError):
    """An invalid schedule, or a placement that the schedule cannot run as a pipeline."""


def _int_at_least(value: object, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ScheduleError(f"Schedule: {name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ScheduleError(f"Schedule: {name} must be at most {high:,}, got {value:,}")
    return int(value)


@dataclass(frozen=True)
class Schedule:
    """A micro-batch pipeline schedule: `kind` ("gpipe", "1f1b", "interleaved-1f1b", or torch's zero-bubble
    schedules "zero-bubble" (interleaved zero bubble, ZB1P), "zbv" and "dualpipev"), `microbatches` M, `chunks` V
    (model chunks per device: 1 for gpipe and 1f1b; interleaved-1f1b at least 2; zero-bubble any; zbv and
    dualpipev exactly 2, in a V; default 2 where more than 1 is possible), and
    `microbatch_graph` (True: the graph given to the simulator was captured at batch/M, so nothing is scaled;
    False: it is the whole batch's step and forward/backward ops are scaled by 1/M), and `device_order` (the
    devices in pipeline order, stage 0's first; None: by index), so that any device can run any stage."""

    kind: str = "1f1b"
    microbatches: int = 1
    chunks: int | None = None
    microbatch_graph: bool = False
    device_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown schedule kind {self.kind!r}; choose one of: {', '.join(KINDS)}")
        object.__setattr__(self, "microbatches", _int_at_least(self.microbatches, "microbatches", 1,
                                                                    MAX_MICROBATCHES))
        multi = self.kind in MULTI_CHUNK
        default = 2 if multi or self.kind == "zero-bubble" else 1
        chunks = default if self.chunks is None else _int_at_least(self.chunks, "chunks", 1, MAX_CHUNKS)
        if self.kind in V_SHAPED and chunks != 2:
            raise ScheduleError(f"Schedule: {self.kind} runs two model chunks per device (a V), got chunks={chunks}")
        if multi and chunks < 2:
            raise ScheduleError(f"Schedule: interleaved-1f1b needs chunks >= 2 (model chunks per device), got "
                                f"{chunks}; with one chunk per device use kind='1f1b'")
        if not multi and self.kind != "zero-bubble" and chunks != 1:
            raise ScheduleError(f"Schedule: {self.kind} runs one model chunk per device, got chunks={chunks}; "
                                "use kind='interleaved-1f1b' for several")
        object.__setattr__(self, "chunks", chunks)
        if not isinstance(self.microbatch_graph, bool):
            raise ScheduleError(f"Schedule: microbatch_graph must be True or False, got {self.microbatch_graph!r}")
        if self.device_order is not None:
            order = self.device_order
            if (not isinstance(order, tuple | list) or len(set(order)) != len(order)
                    or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in order)):
                raise ScheduleError(f"Schedule: device_order must list distinct device indices, got {order!r}")
            object.__setattr__(self, "device_order", tuple(int(d) for d in order))

    def unrunnable(self, devices: int) -> str | None:
        """Why torch.distributed.pipelining cannot run this schedule on a pipeline of `devices` devices (None: it
        can): its 1F1B fills the pipeline before the first backward, so it needs M >= the stages; its interleaved
        1F1B, M a multiple of max(1, M // devices), which M a multiple of the devices (Megatron-LM's order, what
        the simulator runs) satisfies, on 2 or more devices (its chunks go round the devices: one device makes no
        round, and its stages would be one); its interleaved zero bubble (any chunks), M a multiple of those rounds
        (fewer micro-batches than devices run too: torch's zero bubble has no 1F1B fill rule); its DualPipeV, at
        least as many micro-batches as stages (2 per device). GPipe and ZBV run any M."""
        m = self.microbatches
        if self.kind == "dualpipev" and m < 2 * devices:
            return (f"dualpipev runs at least as many micro-batches as stages: {m} micro-batch(es) for {2 * devices} "
                    f"stages (2 per device); use {2 * devices} or more micro-batches, or the zbv schedule")
        if self.kind == "1f1b" and m < devices:
            return (f"1f1b runs at least as many micro-batches as stages: {m} micro-batch(es) for {devices} stages; "
                    f"use {devices} or more micro-batches, or the gpipe schedule")
        if self.kind == "interleaved-1f1b" and devices < 2:
            return (f"interleaved-1f1b runs its {self.chunks or 2} chunks round 2 or more devices, not on {devices}; "
                    "use gpipe or 1f1b (one stage per device)")
        if self.kind == "interleaved-1f1b" and m % devices:
            return (f"interleaved-1f1b needs microbatches to be a multiple of the {devices} devices, got {m}; use a "
                    f"multiple of {devices}")
        rounds = max(1, m // devices)
        if self.kind == "zero-bubble" and m % rounds:
            return (f"zero-bubble runs the micro-batches in M // devices = {rounds} equal rounds, which M={m} does "
                    f"not split; use a multiple of {devices}, or fewer than {devices}")
        return None

    @property
    def label(self) -> str:
        """Short form for reports: "1f1b M=8", "interleaved-1f1b M=8 V=2"."""
        return f"{self.kind} M={self.microbatches}" + (f" V={self.chunks}" if (self.chunks or 1) > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (`device_order` only where it is set)."""
        doc: dict[str, Any] = {"kind": self.kind, "microbatches": self.microbatches, "chunks": self.chunks,
                               "microbatch_graph": self.microbatch_graph}
        if self.device_order is not None:
            doc["device_order"] = list(self.device_order)
        return doc

    @classmethod
    def from_dict(cls, doc: Any) -> Schedule:
        """The schedule of a `to_dict()` document (a placement file's "schedule"); ScheduleError for anything
        else."""
        keys = ("kind", "microbatches", "chunks", "microbatch_graph", "device_order")
        if not isinstance(doc, dict) or set(doc) - set(keys) or "kind" not in doc:
            raise ScheduleError(f"a schedule is an object with keys {', '.join(keys)} (kind required), got {doc!r}")
        doc = dict(doc)
        if isinstance(doc.get("device_order"), list):
            doc["device_order"] = tuple(doc["device_order"])
        return cls(**doc)
