"""Placement semantics: what one placement decision covers, carried by the graph.

Two semantics, one typed value (`Semantics`):

- **op by op** (`"op-by-op"`): every node is placed on its own; a tensor consumed on another device is a copy
  (the edge's bytes over the link). This is the seed study's setting -- TensorFlow graphs in Placeto's
  simulator, each op group a decision -- and the one for generated graph families and hand-written graphs.
- **as autograd runs** (`"autograd"`): a PyTorch training step runs every backward and optimizer op on its
  forward op's device and feeds each input to its first consumer, whatever a placer says; so each tie class
  (`devplace.graph.ties.tie_classes`) is one decision. The one for models captured to be run with
  `plan.apply`.

A graph says which it is placed under in its meta key "semantics" (a top-level key of its JSON file): the
capture writes "autograd", the study's families write "op-by-op", a graph that says nothing is placed op by op.
`semantics_of` resolves it -- the graph's own value or an explicit override -- and is the one place that
does; `devplace.place` and everything above it (plan, study, train, the learned placers) call it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph


class Semantics(StrEnum):
    """What one placement decision covers (see the module docstring)."""

    OP_BY_OP = "op-by-op"
    AUTOGRAD = "autograd"


SEMANTICS_KEY = "semantics"  # the graph meta key (top-level key of a graph JSON file)
DEFAULT_SEMANTICS = Semantics.OP_BY_OP  # a graph whose meta says nothing: hand-written and generated graphs


class SemanticsError(DevplaceError):
    """An unknown placement semantics, given as an option or in a graph's meta."""


def parse_semantics(value: Any, where: str = "semantics") -> Semantics:
    """`value` ("op-by-op", "autograd" or a Semantics) as a Semantics, else a SemanticsError naming `where`."""
    if isinstance(value, Semantics):
        return value
    if isinstance(value, str):
        try:
            return Semantics(value)
        except ValueError:
            pass
    raise SemanticsError(f"{where}: unknown placement semantics {value!r}; choose one of: "
                         f"{', '.join(s.value for s in Semantics)} (op-by-op: every node on its own; autograd: "
                         "backward and optimizer ops with their forward op, as a PyTorch step runs)")


def semantics_of(graph: CompGraph, override: Semantics | str | None = None) -> Semantics:
    """The semantics `graph` is placed under: `override` when given, else the graph's meta "semantics", else
    op by op (`DEFAULT_SEMANTICS`)."""
    if override is not None:
        return parse_semantics(override)
    value = graph.meta.get(SEMANTICS_KEY)
    if value is None:
        return DEFAULT_SEMANTICS
    return parse_semantics(value, f"graph {graph.name!r}, meta key {SEMANTICS_KEY!r} (fix or remove it in the file, "
                                  "or override it with --semantics)")
