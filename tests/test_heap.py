"""The numba kernels' one priority queue (`devplace.graph.heap`): pops come in (time, key) order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from devplace.graph.heap import heap_pop, heap_push

# an operation is a push of (time, key) or a pop (None); few distinct times and keys so that ties are common
ops = st.lists(st.one_of(st.none(), st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.5]), st.integers(-3, 3))),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 5))
def test_pops_come_in_time_then_key_order_with_their_payload(seq: list[tuple[float, int] | None], base: int) -> None:
    cap = base + len(seq) + 2
    ht = np.full(cap, np.nan)
    hk = np.zeros(cap, dtype=np.int64)
    hp = np.zeros(cap, dtype=np.int64)
    size = 0
    pending: list[tuple[float, int, int]] = []  # (time, key, payload) of the entries in the heap
    most = 0
    for i, op in enumerate(seq):
        if op is not None:
            size = heap_push(ht, hk, hp, base, size, op[0], op[1], i)
            pending.append((op[0], op[1], i))
        elif pending:
            top = (float(ht[base]), int(hk[base]), int(hp[base]))
            size = heap_pop(ht, hk, hp, base, size)
            assert top[:2] == min(pending)[:2]  # the smallest (time, key); equal ones in any order
            pending.remove(top)  # with the payload it was pushed with, popped once
        assert size == len(pending)
        most = max(most, size)
    assert np.all(np.isnan(ht[:base])) and np.all(np.isnan(ht[base + most:]))  # it stays within its slice


def test_heaps_sharing_arrays_stay_apart() -> None:
    ht, hk, hp = np.empty(6), np.empty(6, dtype=np.int64), np.empty(6, dtype=np.int64)
    a = b = 0
    for t in (3.0, 1.0, 2.0):
        a = heap_push(ht, hk, hp, 0, a, t, 0, int(t))
        b = heap_push(ht, hk, hp, 3, b, -t, 0, -int(t))
    got_a, got_b = [], []
    while a:
        got_a.append(int(hp[0]))
        a = heap_pop(ht, hk, hp, 0, a)
    while b:
        got_b.append(int(hp[3]))
        b = heap_pop(ht, hk, hp, 3, b)
    assert (got_a, got_b) == ([1, 2, 3], [-3, -2, -1])
