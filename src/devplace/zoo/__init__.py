"""Named models and generated graph families (synthetic layered DAGs for now)."""

from devplace.zoo.synthetic import layered_graph

__all__ = ["layered_graph"]
