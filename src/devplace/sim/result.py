"""`SimResult`: what a simulation of one training step under one placement finds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class Transfers:
    """Every transfer of the step, in the order the simulator started them (arrays of equal length).

    `dst_dev` is -1 for a broadcast on a source device's bus (the `placeto` model sends each output once).
    `finish_s` is when the data arrives; a channel may stay busy longer (the `placeto` model's delta2).
    """

    node: np.ndarray  # int64, producing node index
    tensor: np.ndarray  # int64, output index of that node
    src_dev: np.ndarray  # int64
    dst_dev: np.ndarray  # int64, -1 = bus broadcast
    nbytes: np.ndarray  # float64
    start_s: np.ndarray  # float64
    finish_s: np.ndarray  # float64

    def __len__(self) -> int:
        return int(self.node.shape[0])


@dataclass(frozen=True, eq=False)
class SimResult:
    """Step time, per-op schedule, per-device memory and busy time, and every transfer."""

    model: str
    step_time_s: float
    device: np.ndarray  # int64[V], device index of each op
    start_s: np.ndarray  # float64[V]
    finish_s: np.ndarray  # float64[V]
    peak_memory_bytes: np.ndarray  # float64[D]
    memory_bytes: np.ndarray  # float64[D], each device's capacity
    device_busy_s: np.ndarray  # float64[D], total compute time on each device
    comm_bytes: float  # total bytes moved between devices
    transfers: Transfers
    # float64[D]: of each device's peak, the bytes of forward ops' outputs live then (kept or received), the
    # activations; None where the model does not say (`placeto-sim`)
    peak_activation_bytes: np.ndarray | None = field(default=None, kw_only=True)

    @property
    def feasible(self) -> bool:
        """True iff every device's peak memory is at most its capacity."""
        return bool(np.all(self.peak_memory_bytes <= self.memory_bytes))

    @property
    def oom(self) -> dict[int, float]:
        """Devices whose peak exceeds capacity -> by how many bytes."""
        over = self.peak_memory_bytes - self.memory_bytes
        return {int(d): float(over[d]) for d in np.flatnonzero(over > 0)}

    def to_dict(self, ids: tuple[str, ...] | None = None, per_op: bool = False) -> dict[str, Any]:
        """JSON-ready summary; with `per_op` (and the graph's `ids`) also each op's device, start, finish."""
        doc: dict[str, Any] = {
            "model": self.model,
            "step_time_s": self.step_time_s,
            "feasible": self.feasible,
            "peak_memory_bytes": self.peak_memory_bytes.tolist(),
            "memory_bytes": self.memory_bytes.tolist(),
            "oom": {str(d): b for d, b in self.oom.items()},
            "comm_bytes": self.comm_bytes,
            "num_transfers": len(self.transfers),
            "device_busy_s": self.device_busy_s.tolist(),
        }
        if per_op:
            names = ids if ids is not None else tuple(str(v) for v in range(self.device.shape[0]))
            doc["ops"] = {nid: {"device": int(self.device[v]), "start_s": float(self.start_s[v]),
                                "finish_s": float(self.finish_s[v])} for v, nid in enumerate(names)}
        return doc
