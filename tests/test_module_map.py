"""Hand-made module maps (`devplace.placement_from_module_map`) and custom `package.module:factory` models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devplace
from devplace.capture.custom import (
    CustomModelError,
    build_named_model,
    capture_named_model,
    load_factory,
)
from devplace.graph.batch import graph_batch, graph_microbatches
from devplace.graph.modules import forward_ops
from devplace.runtime import plan
from devplace.runtime.module_map import ModuleMapError


class _Net(nn.Module):
    """stem -> two blocks -> head, with the root's own code (a residual add) between the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


@pytest.fixture(scope="module")
def net_plan():
    torch.manual_seed(0)
    return plan(_Net(), torch.randn(4, 8), "3xGPU-placeto", placer="single", order="topo")


def _fwd_devices(p, placement) -> dict[str, int]:
    return {p.graph.ids[v]: placement.assignment[p.graph.ids[v]] for v in forward_ops(p.graph)}


def test_device_map_places_every_op_and_autograd_follows(net_plan):
    p = net_plan
    placement = devplace.placement_from_module_map(p.graph, p.cluster,
                                                   {"stem": 0, "blocks.0": "cuda:1", "blocks.1": "gpu2", "head": 2})
    g = p.graph
    for v in range(g.num_nodes):
        nid, m = g.ids[v], str(g.node_extra[v].get("module", ""))
        if g.kind[v] == "forward" and m.startswith("blocks.0"):
            assert placement.assignment[nid] == 1
        if g.kind[v] != "forward" and g.group[v] in g.index:  # backward and optimizer ops with their forward op
            assert placement.assignment[nid] == placement.assignment[g.group[v]]
    # the root's own residual adds run where the previous op ran (as under accelerate's hooks)
    adds = [nid for nid, d in _fwd_devices(p, placement).items() if nid.startswith("/add")]
    assert [placement.assignment[a] for a in adds] == [1, 2]
    r = devplace.simulate(g, p.cluster, placement)
    assert r.feasible and r.step_time_s > 0


def test_split_list_gives_the_same_placement_as_the_equivalent_map(net_plan):
    p = net_plan
    split = devplace.placement_from_module_map(p.graph, p.cluster, ["blocks.0", "head"])
    hf = devplace.placement_from_module_map(p.graph, p.cluster, {"stem": 0, "blocks": 1, "head": 2})
    assert _fwd_devices(p, split) == _fwd_devices(p, hf)
    assert split.assignment == hf.assignment


@pytest.mark.parametrize(("module_map", "match"), [
    ({"stem": 0, "blocks": 1, "haed": 2}, r"names module 'haed'.*did you mean 'head'"),
    ({"": 5}, r"device 5 is not a device of cluster"),
    ({"": "tpu:0"}, r"device 'tpu:0' is not a device"),
    ({"stem": 0, "blocks": 1}, r"leaves the ops of 1 module\(s\) unmapped, e.g. 'head'"),
    (["head", "blocks.0"], r"not in program order"),
    (["blocks.0", "blocks.1", "head"], r"4 stages, but cluster .* has 3 devices"),
    (["nope"], r"split point 'nope'"),
    ({}, r"maps no module"),
    ("stem", r"device_map .* or a list of split points"),
])
def test_bad_maps_say_what_is_wrong(net_plan, module_map, match):
    with pytest.raises(ModuleMapError, match=match):
        devplace.placement_from_module_map(net_plan.graph, net_plan.cluster, module_map)


def test_tensor_names_are_accepted_only_when_declared(net_plan):
    p = net_plan
    m = {"": 0, "stem.weight": 1}
    with pytest.raises(ModuleMapError, match=r"'stem\.weight'"):
        devplace.placement_from_module_map(p.graph, p.cluster, m)
    placement = devplace.placement_from_module_map(p.graph, p.cluster, m, tensors=["stem.weight"])
    assert set(placement.assignment.values()) == {0}


def test_map_files_round_trip_the_exports(net_plan, tmp_path):
    import json

    from devplace.runtime.export import device_map, pipeline_split
    from devplace.runtime.module_map import read_module_map

    p = net_plan
    placement = devplace.placement_from_module_map(p.graph, p.cluster, {"stem": 0, "blocks": 1, "head": 2})
    dm = device_map(p.graph, placement, p.cluster)
    split = pipeline_split(p.graph, placement)
    files = {"dm.json": {"format": "devplace.device_map/1", "device_map": dm.named()}, "pipe.json": split.to_dict(),
             "plain.json": {"stem": 0, "blocks": 1, "head": 2}, "list.json": ["blocks.0", "head"]}
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
        again = devplace.placement_from_module_map(p.graph, p.cluster, read_module_map(tmp_path / name))
        assert again.assignment == placement.assignment, name
    (tmp_path / "bad.json").write_text('{"format": "devplace.plan/1"}')
    with pytest.raises(ModuleMapError, match="a module map is a JSON object"):
        read_module_map(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ModuleMapError, match="not valid JSON"):
        read_module_map(tmp_path / "broken.json")
    with pytest.raises(ModuleMapError, match="cannot read module map"):
        read_module_map(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------ custom models
FACTORIES = '''
import torch
from torch import nn


def build(batch=2):
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(batch, 4)


def with_loss():
    model = nn.Linear(3, 2)
    return model, (torch.randn(2, 3),), lambda out: out.pow(2).mean()


def no_sizes():
    return nn.Linear(3, 2), (torch.randn(2, 3),)


def one_thing():
    return nn.Linear(3, 2)


def not_a_module():
    return "model", (torch.randn(2, 3),)


NOT_CALLABLE = 3
'''


@pytest.fixture
def factories(python_package):
    return python_package("mymodels_pkg", FACTORIES)


def test_custom_model_builds_and_captures_like_a_zoo_model(factories):
    module, inputs, loss_fn = build_named_model(f"{factories}:build", batch=3)
    assert isinstance(module, nn.Sequential) and inputs[0].shape == (3, 4) and loss_fn is None
    _, inputs2, _ = build_named_model(f"{factories}:build", batch=3)
    assert torch.equal(inputs[0], inputs2[0])  # seeded by devplace (the factory is not)
    g = capture_named_model(f"{factories}:build", batch=3)
    assert g.name == "build-b3" and {str(e.get("module")) for e in g.node_extra} >= {"0", "2"}
    g2 = capture_named_model(f"{factories}:with_loss")
    assert any(g2.op[v] == "aten.pow.Tensor_Scalar" for v in range(g2.num_nodes))  # its own loss_fn ran


def test_micro_batches_of_a_factory_that_sizes_its_own_inputs_are_its_first_samples(factories):
    # the factory takes no batch=: a micro-batch is the captured step on the first batch / M samples, as
    # devplace.plan cuts a module's inputs (it used to be refused, so placer auto could not place such a model)
    from devplace.capture.custom import microbatch_prepared, named_prepared

    prepared = named_prepared(f"{factories}:no_sizes")
    micro = microbatch_prepared(prepared, 2)
    assert graph_batch(micro.full) == 1 and graph_microbatches(micro.full) == 2
    assert micro.full.num_nodes == prepared.full.num_nodes


@pytest.mark.parametrize(("suffix", "kwargs", "match"), [
    ("nope_pkg.x:build", {}, r"cannot import module 'nope_pkg.x'"),
    ("{m}:missing", {}, r"has no attribute 'missing'"),
    ("{m}:NOT_CALLABLE", {}, r"is a int, not a function"),
    ("{m}:one_thing", {}, r"must return \(module, example_inputs\)"),
    ("{m}:not_a_module", {}, r"must be a torch.nn.Module, got str"),
    ("{m}:no_sizes", {"batch": 4}, r"takes no 'batch' argument; drop --batch"),
    ("{m}", {}, r"must be written package.module:factory"),
])
def test_custom_model_errors_are_clear(factories, suffix, kwargs, match):
    name = suffix.format(m=factories)
    with pytest.raises(CustomModelError, match=match):
        if ":" in name:
            build_named_model(name, **kwargs)
        else:
            load_factory(name)
