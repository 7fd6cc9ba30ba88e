"""`devplace run` on logical devices that share a real one: simulated as sharing it, steps' spread and threads
reported (issue 23 item 4)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from devplace.runtime import plan
from devplace.runtime.run import local_cluster, measure_plan, shared_simulation
from devplace.sim import DevplaceModel


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, (torch.randn(8, 16),)


def test_logical_devices_on_one_real_device_are_simulated_on_it():
    model, inputs = _tiny()
    cluster = local_cluster(["cpu", "cpu"])
    p = plan(model, inputs, cluster, placer="round-robin", order="topo")
    devices = p.runtime_placement.to_array(p.graph, 2)
    assert len(set(devices.tolist())) == 2  # the plan uses both logical devices, in parallel where it can
    shared = shared_simulation(p.graph, cluster, p.runtime_placement, [torch.device("cpu")] * 2)
    one = DevplaceModel(p.graph, cluster).run(np.zeros_like(devices))  # every op on the one real CPU
    assert shared.step_time_s == one.step_time_s and shared.step_time_s != p.runtime_result.step_time_s
    assert shared_simulation(p.graph, cluster, p.runtime_placement, [torch.device("cpu"), torch.device("meta")]) \
        is None  # each logical device on a real one of its own: the plan's simulation stands


def test_the_run_record_compares_with_the_shared_simulation_and_reports_threads_and_spread():
    model, inputs = _tiny()
    cluster = local_cluster(["cpu", "cpu"])
    p = plan(model, inputs, cluster, placer="round-robin", order="topo")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, run, rec = measure_plan(p, model, inputs, ["cpu", "cpu"], steps=3, warmup=0)
    finally:
        torch.set_num_threads(threads)
    shared = shared_simulation(p.graph, cluster, p.runtime_placement, [torch.device("cpu")] * 2)
    assert rec["simulated_step_s"] == shared.step_time_s and rec["settings"]["shared_devices"] is True
    assert rec["settings"]["as_run_on_separate_devices_s"] == p.runtime_result.step_time_s
    assert rec["threads"] == 1 and rec["measured_spread"] == run.spread >= 0.0
