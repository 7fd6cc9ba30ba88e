"""The one priority queue of devplace's numba kernels: a binary min-heap on flat arrays.

A heap is the slice [base, base + size) of three parallel arrays: `ht` (float64 time, the primary key), `hk`
(int64 tie-break, the secondary key) and `hp` (int64 payload, carried along, never compared). The entry with
the smallest (time, key) is at index `base`. Several heaps can share one set of arrays at different bases
(the simulator keeps one ready heap per device that way). The caller owns the arrays and the sizes: push
returns the new size, pop removes the top (read `ht[base]`, `hk[base]`, `hp[base]` first) and returns the new
size; the arrays must have room for every entry pushed.

Every kernel keys its entries so that no two pending entries have the same (time, key) -- or, where they can,
so that such entries are interchangeable -- so the sequence of pops does not depend on how the heap breaks
ties, and any correct heap gives the same results.

It lives in `graph/` because `graph/` (coarsening) is the lowest package that uses it; `sim/` and `placers/`
import it from here. It imports nothing of devplace.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def heap_push(ht: np.ndarray, hk: np.ndarray, hp: np.ndarray, base: int, size: int, t: float, k: int,
              p: int) -> int:  # pragma: no cover - compiled
    """Insert (t, k) with payload p into the heap of `size` entries at `base`; returns size + 1."""
    i = size
    while i > 0:  # move the hole up past every parent that comes after (t, k)
        parent = (i - 1) >> 1
        j = base + parent
        if ht[j] < t or (ht[j] == t and hk[j] <= k):
            break
        ht[base + i] = ht[j]
        hk[base + i] = hk[j]
        hp[base + i] = hp[j]
        i = parent
    ht[base + i] = t
    hk[base + i] = k
    hp[base + i] = p
    return size + 1


@njit(cache=True)
def heap_pop(ht: np.ndarray, hk: np.ndarray, hp: np.ndarray, base: int, size: int) -> int:  # pragma: no cover
    """Remove the top entry (read it at `base` first) of the heap of `size` >= 1 entries; returns size - 1."""
    size -= 1
    last = base + size
    t = ht[last]
    k = hk[last]
    p = hp[last]
    i = 0
    while True:  # move the hole down past every smaller child, then put the last entry in it
        c = 2 * i + 1
        if c >= size:
            break
        cj = base + c
        if c + 1 < size and (ht[cj + 1] < ht[cj] or (ht[cj + 1] == ht[cj] and hk[cj + 1] < hk[cj])):
            c += 1
            cj += 1
        if t < ht[cj] or (t == ht[cj] and k <= hk[cj]):
            break
        ht[base + i] = ht[cj]
        hk[base + i] = hk[cj]
        hp[base + i] = hp[cj]
        i = c
    ht[base + i] = t
    hk[base + i] = k
    hp[base + i] = p
    return size
