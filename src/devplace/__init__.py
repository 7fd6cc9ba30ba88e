"""devplace: device placement for model-parallel training, with the graph traversal order as a parameter.

The public API: load graphs, clusters and placements, simulate a placement, compute the lower bound.
"""

from devplace.errors import DevplaceError
from devplace.graph import CompGraph, Placement, load_graph, load_placement, save_graph, save_placement
from devplace.hardware import Cluster, load_cluster, save_cluster
from devplace.hardware.features import graph_features
from devplace.orders import traversal_order
from devplace.placers import place, placer_names
from devplace.sim import SimResult, lower_bound, simulate

__version__ = "0.1.0"

__all__ = ["Cluster", "CompGraph", "DevplaceError", "Placement", "SimResult", "graph_features", "load_cluster",
           "load_graph", "load_placement", "lower_bound", "place", "placer_names", "save_cluster", "save_graph",
           "save_placement", "simulate", "traversal_order"]
