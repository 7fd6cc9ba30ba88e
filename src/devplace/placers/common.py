"""Small helpers shared by several placers (functions only; each placer module stays readable on its own)."""

from __future__ import annotations

import numbers
import os
import sys
from typing import Any

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.placers.registry import PlacerError
from devplace.sim.result import SimResult
from devplace.units import fmt_bytes


def op_memory(graph: CompGraph) -> np.ndarray:
    """Baechi's memory of one op: `param_bytes + output_bytes + temp_bytes` (float64[V])."""
    return graph.param_bytes + graph.output_bytes + graph.temp_bytes


def describe_oom(result: SimResult) -> str:
    """The devices a simulated placement overfills, for an error message: "device 1 (peak 17.20 GB of
    16.00 GB), ..."; empty when the placement is feasible."""
    return ", ".join(f"device {d} (peak {fmt_bytes(float(result.peak_memory_bytes[d]))} of "
                     f"{fmt_bytes(float(result.memory_bytes[d]))})" for d in result.oom)


def positive_int(value: object, setting: str, placer: str, high: int | None = None) -> int:
    """`value` as an int >= 1 (and <= `high`, the setting's limit, when given), or a PlacerError naming the
    placer's setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1 or (
            high is not None and value > high):
        limit = "" if high is None else f" and at most {high:,}"
        raise PlacerError(f"placer {placer!r}: setting {setting!r} must be an integer >= 1{limit}, got {value!r}")
    return int(value)


def silent_highs() -> Any:
    """A HiGHS instance that prints nothing and uses one thread.

    The first instance in a process writes a banner to stdout from C++; it goes to /dev/null so that
    `--json` output stays clean. HiGHS has one global thread pool, sized by the first run in the process,
    and a later run asking for another size fails: so every devplace user of HiGHS asks for one thread.
    """
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    return h
