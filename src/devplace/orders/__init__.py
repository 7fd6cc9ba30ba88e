"""Traversal orders (DESIGN.md section 6): the order in which a sequential placer visits the graph.

`traversal_order(graph, order, seed=0, cluster=None)` gives node ids, `traversal_indices` node indices; `order`
is a registered order name (`ORDERS`), a sequence listing every node id once, or a callable graph -> such a
sequence. Every named order is computed by devplace's own iterative code over the graph's insertion order, so it
does not change with a library's version; see docs/orders.md for the definitions and a worked example. A new
order is one function registered with `@register_order` in `orders/traversal.py`.
"""

from devplace.orders.traversal import (
    ORDER_DEFINITIONS,
    ORDERS,
    TOPOLOGICAL_ORDERS,
    CustomOrderFn,
    Order,
    OrderError,
    OrderInput,
    OrderSpec,
    bottom_levels,
    check_order,
    check_order_name,
    order_label,
    register_order,
    traversal_indices,
    traversal_order,
)

__all__ = ["ORDERS", "ORDER_DEFINITIONS", "TOPOLOGICAL_ORDERS", "CustomOrderFn", "Order", "OrderError", "OrderInput",
           "OrderSpec", "bottom_levels", "check_order", "check_order_name", "order_label", "register_order",
           "traversal_indices", "traversal_order"]
