"""Sparse embedding gradients (`nn.Embedding(sparse=True)`) are sized as the rows a batch touches, not the table."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from devplace.capture import capture

ROWS, DIM, BATCH, BAG = 50_000, 16, 8, 4


class Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).sum(1)).sum()


def captured(sparse: bool):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on sparse invariant checks
        return capture(Bag(sparse), (torch.randint(0, ROWS, (BATCH, BAG)),), optimizer="sgd")


@pytest.mark.parametrize("sparse", [False, True])
def test_embedding_gradient_and_update_are_sized_by_the_rows_used(sparse):
    g = captured(sparse)
    table = ROWS * DIM * 4
    rows = BATCH * BAG * (DIM * 4 + 8)  # one value row and one int64 index per looked-up id
    update = next(v for v in range(g.num_nodes) if g.kind[v] == "optimizer" and g.ids[v].startswith("emb/"))
    moved = g.node_extra[update]["mem_access_bytes"]  # what the analytic cost model times the update by
    if sparse:
        assert g.param_bytes[update] == table + rows  # the weight, and its gradient's rows
        assert moved <= 4 * rows
    else:
        assert g.param_bytes[update] == 2 * table  # the weight and its dense gradient
        assert moved >= 2 * table
