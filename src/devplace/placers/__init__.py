"""Placers behind one interface: `place(graph, cluster, *, placer, order, seed, **settings)`.

Each placer is one module of this package, registered by name with `@register`; `placer_names()` lists
them and `devplace placers` shows which ones walk the graph in the traversal order.
"""

from devplace.placers.expanded import ExpandedPlacement, place_expanded
from devplace.placers.memory import MemoryNeeds, NoFitError, memory_needs, no_fit_error
from devplace.placers.registry import (
    PlacerError,
    PlacerOutput,
    PlacerSpec,
    SearchProgress,
    get_placer,
    place,
    placer_names,
    register,
    schedule_of,
)

__all__ = ["ExpandedPlacement", "MemoryNeeds", "NoFitError", "PlacerError", "PlacerOutput", "PlacerSpec",
           "SearchProgress", "get_placer", "memory_needs", "no_fit_error", "place", "place_expanded",
           "placer_names", "register", "schedule_of"]
