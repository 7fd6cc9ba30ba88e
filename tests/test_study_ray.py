"""A study on a Ray cluster of two nodes started on this machine (issue 22 item 5): the head takes no tasks, so
every cell runs on the other node, through `--backend ray --address` as on a real cluster."""

from __future__ import annotations

import os

import pytest

from devplace.graph import load_graph, save_graph
from devplace.hardware import load_cluster
from devplace.study.grid import expand
from devplace.study.runner import run_cell, run_study
from devplace.study.spec import parse_study
from devplace.study.store import read_cells
from devplace.zoo import layered_graph

STUDY = """
name = "two-nodes"
graphs = ["g.json"]
clusters = ["3xGPU-placeto"]
orders = ["topo", "bfs"]
seeds = [0]
[[placers]]
name = "m-topo"
[[placers]]
name = "placeto"
settings = {episodes = 1, hidden = 8, rounds = 2}
"""


@pytest.fixture
def two_nodes():
    """A head with no CPUs for tasks and one worker node of 1 CPU, as separate Ray processes on this machine."""
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster, node
    cluster.shutdown()


def test_a_study_runs_on_the_worker_node_of_a_two_node_cluster(tmp_path, two_nodes):
    cluster, node = two_nodes
    save_graph(layered_graph(24, width=4, seed=0), tmp_path / "g.json")
    spec = parse_study(STUDY, base_dir=tmp_path)
    s = run_study(spec, tmp_path / "ray.sqlite", backend="ray", address=cluster.address)
    assert s.ran == 4 and s.failed == 0
    rows = {r["key"]: r for r in read_cells(tmp_path / "ray.sqlite")}
    g, c = load_graph(tmp_path / "g.json"), load_cluster("3xGPU-placeto")
    for cell in expand(spec):  # the same rows as this process computes
        here = run_cell(cell, g, c)
        assert rows[cell.key]["status"] == "ok" and rows[cell.key]["step_time_s"] == here["step_time_s"]
        assert rows[cell.key]["semantics"] == "op-by-op"
    # the head has no CPU to give (num_cpus 0), so Ray could run the one-CPU tasks only on the added node
    assert len(cluster.list_all_nodes()) == 2 and node in cluster.worker_nodes
    assert all(r["worker"].rsplit(":", 1)[1] != str(os.getpid()) for r in rows.values())
