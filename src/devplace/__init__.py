"""devplace: device placement for model-parallel training, with the graph traversal order as a parameter.

The public API: load graphs, clusters and placements, simulate a placement, compute the lower bound.
"""

from typing import Any

from devplace.errors import DevplaceError
from devplace.graph import CompGraph, Placement, load_graph, load_placement, save_graph, save_placement
from devplace.hardware import Cluster, load_cluster, save_cluster
from devplace.hardware.features import graph_features
from devplace.orders import traversal_order
from devplace.placers import place, placer_names
from devplace.sim import SimResult, lower_bound, simulate

__version__ = "0.1.0"


def train(*args: Any, **kwargs: Any) -> Any:
    """Train one placeto policy over several graphs; see `devplace.placers.rl.trainer.train` (imported on first
    use: it needs torch)."""
    from devplace.placers.rl.trainer import train as _train

    return _train(*args, **kwargs)


def plan(*args: Any, **kwargs: Any) -> Any:
    """Capture, cost, coarsen, place and simulate a module's training step: `plan(model, example_inputs, cluster,
    *, placer="m-etf", order="topo", optimizer="adam", max_nodes=None, seed=0)`; see `devplace.runtime.plan.plan`
    (imported on first use: it needs torch)."""
    from devplace.runtime.plan import plan as _plan

    return _plan(*args, **kwargs)


def load_plan(path: Any) -> Any:
    """Read a `devplace.plan/1` file; see `devplace.runtime.plan.load_plan`."""
    from devplace.runtime.plan import load_plan as _load_plan

    return _load_plan(path)


__all__ = ["Cluster", "CompGraph", "DevplaceError", "Placement", "SimResult", "graph_features", "load_cluster",
           "load_graph", "load_placement", "load_plan", "lower_bound", "place", "placer_names", "plan", "save_cluster",
           "save_graph", "save_placement", "simulate", "train", "traversal_order"]
