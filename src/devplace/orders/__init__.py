"""Traversal orders (DESIGN.md section 6): the order in which a sequential placer visits the graph.

`traversal_order(graph, name, seed=0, cluster=None)` gives node ids, `traversal_indices` node indices.
Every order is computed by devplace's own iterative code over the graph's insertion order, so it does not
change with a library's version; see docs/orders.md for the definitions and a worked example.
"""

from devplace.orders.traversal import (
    ORDER_DEFINITIONS,
    ORDERS,
    TOPOLOGICAL_ORDERS,
    OrderError,
    bottom_levels,
    check_order_name,
    traversal_indices,
    traversal_order,
)

__all__ = ["ORDERS", "ORDER_DEFINITIONS", "TOPOLOGICAL_ORDERS", "OrderError", "bottom_levels",
           "check_order_name", "traversal_indices", "traversal_order"]
