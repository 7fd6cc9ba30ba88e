"""How many steps a search simulated: `with counting() as count:` ... `count.runs`.

Every run of a simulation model (`DevplaceModel.run`, `PlacetoSimModel.run`; a pipelined step is one run of its
unrolled graph) adds one to every count open in the current context, so a report can say what its answer cost
without threading a counter through every placer. Counts nest; nothing is counted outside `counting()`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class SimulationCount:
    """The simulations run while a `counting()` block is open."""

    runs: int = 0


_OPEN: ContextVar[tuple[SimulationCount, ...]] = ContextVar("devplace_simulation_counts", default=())


@contextmanager
def counting() -> Iterator[SimulationCount]:
    """Count the simulations run inside the block (those of nested blocks included)."""
    count = SimulationCount()
    token = _OPEN.set((*_OPEN.get(), count))
    try:
        yield count
    finally:
        _OPEN.reset(token)


def note_simulation() -> None:
    """One simulation ran: every open count grows by one."""
    for count in _OPEN.get():
        count.runs += 1
