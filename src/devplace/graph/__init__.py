"""The data model: `CompGraph`, its JSON format, validation, and `Placement`. Imports nothing of devplace
but `devplace.errors`."""

from devplace.graph.compgraph import CompGraph, canonical_topo_order
from devplace.graph.io import load_graph, save_graph
from devplace.graph.placement import Placement, load_placement, save_placement
from devplace.graph.semantics import Semantics, semantics_of

__all__ = ["CompGraph", "Placement", "Semantics", "canonical_topo_order", "load_graph", "load_placement", "save_graph",
           "save_placement", "semantics_of"]
