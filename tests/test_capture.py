"""devplace.capture: training-step capture of PyTorch modules (docs/capture-format.md, docs/capture.md)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from math import prod
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from devplace.capture import CaptureError, capture, conv_backward_flop, flop_counter_mode
from devplace.graph import CompGraph

os.environ.setdefault("HF_HUB_OFFLINE", "1")

F32 = 4


# ----------------------------------------------------------------------------------------------- models
class DepthwiseCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.dw = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16)  # depthwise
        self.bn2 = nn.BatchNorm2d(16)
        self.pw = nn.Conv2d(16, 24, 1)
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.stem(x)))
        x = nn.functional.relu(self.bn2(self.dw(x)), inplace=True)
        x = self.pw(x)
        return self.head(x.mean(dim=(2, 3)))


class TinyLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.fc = nn.Linear(32, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(x))
        return self.fc(h)


def _mlp() -> tuple[nn.Module, Any]:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)), torch.randn(3, 4)


def _cnn() -> tuple[nn.Module, Any]:
    return DepthwiseCNN(), torch.randn(2, 3, 16, 16)


def _lstm() -> tuple[nn.Module, Any]:
    return TinyLSTM(), torch.randint(0, 50, (2, 5))


def _gpt2_config(**kw: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, use_cache=False, **kw)


def _gpt2(**kw: Any) -> tuple[nn.Module, Any]:
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = GPT2LMHeadModel(_gpt2_config(**kw))
    ids = torch.randint(0, 1000, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


MODELS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {"mlp": _mlp, "cnn": _cnn, "gpt2": _gpt2, "lstm": _lstm}


def _run(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _loss(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out.sum()


_CACHE: dict[tuple[str, str], tuple[nn.Module, Any, CompGraph]] = {}


def captured(name: str, optimizer: str = "adam") -> tuple[nn.Module, Any, CompGraph]:
    """(real model, real inputs, graph) of one of MODELS, captured once per test session."""
    key = (name, optimizer)
    if key not in _CACHE:
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
        _CACHE[key] = (model, inputs, capture(model, inputs, optimizer=optimizer))
    return _CACHE[key]


def _extra(g: CompGraph, v: int, key: str) -> Any:
    return g.node_extra[v][key]


# ----------------------------------------------------------------------------------------------- FLOPs
def _captured_flops_by_op(g: CompGraph) -> dict[str, int]:
    out: Counter[str] = Counter()
    for v in range(g.num_nodes):
        if g.kind[v] != "optimizer" and _extra(g, v, "flops"):
            out[g.op[v].rsplit(".", 1)[0]] += _extra(g, v, "flops")  # aten.mm.default -> aten.mm
    return dict(out)


@pytest.mark.parametrize("name", list(MODELS))
def test_flops_equal_flop_counter_mode_per_op(name: str) -> None:
    """Forward + backward FLOPs equal FlopCounterMode's on a real run, op by op (same corrections both sides)."""
    model, inputs, g = captured(name)
    with flop_counter_mode() as counter:
        _loss(_run(model, inputs)).backward()
    model.zero_grad(set_to_none=True)
    ref = {str(k): int(v) for k, v in counter.get_flop_counts()["Global"].items() if v}
    assert _captured_flops_by_op(g) == ref
    assert sum(ref.values()) > 0


def test_depthwise_backward_fix_differs_from_stock_pytorch() -> None:
    """The stock formula over-counts the depthwise convolution's weight gradient by its groups; ours does not."""
    model, inputs, g = captured("cnn")
    with FlopCounterMode(display=False) as stock:
        _loss(_run(model, inputs)).backward()
    model.zero_grad(set_to_none=True)
    stock_bwd = stock.get_flop_counts()["Global"][torch.ops.aten.convolution_backward]
    ours_bwd = sum(_extra(g, v, "flops") for v in range(g.num_nodes) if g.op[v] == "aten.convolution_backward.default")
    dw = next(v for v in range(g.num_nodes) if g.ids[v] == "dw/convolution_backward#0")
    # dw: x [2,16,16,16] -> out [2,16,8,8], 3x3 depthwise: forward FLOPs 2*N*C_out*(C_in/g)*k*k*Ho*Wo per gradient
    per_grad = 2 * 2 * 16 * 1 * 9 * 8 * 8
    assert _extra(g, dw, "flops") == 2 * per_grad
    assert stock_bwd - ours_bwd == (16 - 1) * per_grad  # the weight gradient counted 16x by PyTorch


def _hand_conv_flops(x: list[int], w: list[int], out: list[int], groups: int, transposed: bool) -> int:
    """2 FLOPs per multiply-add: each output element of a convolution sums (C_in/groups) * prod(k) products; a
    transposed convolution scatters each input element over (C_out/groups) * prod(k) outputs."""
    n, c_in, c_out, k = x[0], x[1], out[1], prod(w[2:])
    if transposed:
        return 2 * n * c_in * prod(x[2:]) * (c_out // groups) * k
    return 2 * n * c_out * prod(out[2:]) * (c_in // groups) * k


@pytest.mark.parametrize(("c_in", "c_out", "groups", "stride", "transposed", "mask"), [
    (8, 8, 1, 1, False, (True, True, False)),
    (8, 16, 4, 2, False, (True, True, True)),
    (32, 32, 32, 1, False, (True, True, False)),  # depthwise
    (32, 32, 32, 2, False, (False, True, False)),  # depthwise, first layer (no input gradient)
    (8, 12, 4, 2, True, (True, True, False)),  # grouped transposed
    (16, 16, 16, 1, True, (True, False, False)),
])
def test_conv_backward_flop_against_hand_formula(c_in: int, c_out: int, groups: int, stride: int,
                                                  transposed: bool, mask: tuple[bool, bool, bool]) -> None:
    x = torch.randn(2, c_in, 10, 10)
    w = torch.randn(c_in, c_out // groups, 3, 3) if transposed else torch.randn(c_out, c_in // groups, 3, 3)
    conv = nn.functional.conv_transpose2d if transposed else nn.functional.conv2d
    out = conv(x, w, stride=stride, padding=1, groups=groups)
    args = (out, x, w, [c_out], [stride, stride], [1, 1], [1, 1], transposed, [0, 0], groups, list(mask))
    grads = torch.ops.aten.convolution_backward(*args)
    flops = conv_backward_flop(*[a.shape if isinstance(a, torch.Tensor) else a for a in args],
                               out_shape=[t.shape if t is not None else None for t in grads])
    one = _hand_conv_flops(list(x.shape), list(w.shape), list(out.shape), groups, transposed)
    assert flops == one * (int(mask[0]) + int(mask[1]))


def test_lstm_flops_are_its_matrix_products() -> None:
    _, _, g = captured("lstm")
    layer0 = g.index["lstm/mkldnn_rnn_layer#0"]
    # tokens 2*5, gates 4*32, input 16 + hidden 32
    assert _extra(g, layer0, "flops") == 2 * 10 * 128 * (16 + 32)
    bwd0 = next(v for v in range(g.num_nodes) if g.op[v].startswith("aten.mkldnn_rnn_layer_backward")
                and g.group[v] == "lstm/mkldnn_rnn_layer#0")
    assert _extra(g, bwd0, "flops") == 2 * _extra(g, layer0, "flops")


def test_cpu_flash_attention_is_captured_when_a_real_cpu_run_uses_it() -> None:
    """Without attention dropout a CPU run uses the fused flash kernel, and so does the capture."""
    torch.manual_seed(0)
    model, inputs = _gpt2(attn_pdrop=0.0)
    g = capture(model, inputs)
    ops = Counter(g.op)
    assert ops["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 2
    assert ops["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] == 2
    with flop_counter_mode() as counter:
        _loss(_run(model, inputs)).backward()
    assert _captured_flops_by_op(g) == {str(k): int(v) for k, v in counter.get_flop_counts()["Global"].items() if v}


# ----------------------------------------------------------------------------------------------- bytes
def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


def _buffer_bytes(model: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("optimizer", "states"), [("adam", 2), ("sgd", 0), ("none", 0)])
def test_param_bytes_are_weights_grads_and_state(name: str, optimizer: str, states: int) -> None:
    model, _, g = captured(name, optimizer)
    params = _n_params(model)
    assert g.meta["capture"]["params"] == params
    assert g.meta["capture"]["param_bytes"] == params * F32 * (1 + 1 + states)
    assert g.meta["capture"]["buffer_bytes"] == _buffer_bytes(model)
    assert g.param_bytes.sum() == params * F32 * (1 + 1 + states) + _buffer_bytes(model)


def test_sgd_momentum_and_frozen_parameters() -> None:
    model, x = _mlp()
    model[0].weight.requires_grad_(False)
    g = capture(model, x, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False))
    frozen = model[0].weight.numel()
    trainable = _n_params(model) - frozen
    assert g.meta["capture"]["optimizer"] == "sgd"
    assert g.param_bytes.sum() == frozen * F32 + trainable * F32 * (1 + 1 + 1)
    # the frozen weight sits on its first forward consumer, the others on their update ops
    assert g.param_bytes[g.index["0/addmm#0"]] == frozen * F32
    assert all(g.kind[v] == "optimizer" for v in range(g.num_nodes) if g.param_bytes[v] and g.ids[v] != "0/addmm#0")


def test_param_bytes_owner() -> None:
    _, _, g = captured("mlp")
    owners = [v for v in range(g.num_nodes) if g.param_bytes[v]]
    assert [g.op[v] for v in owners] == ["aten.addcdiv_.default"] * 4  # Adam's update of each parameter
    assert [g.param_bytes[v] for v in owners] == [32 * 16, 8 * 16, 16 * 16, 2 * 16]
    _, _, g = captured("mlp", "none")
    assert {g.ids[v]: g.param_bytes[v] for v in range(g.num_nodes) if g.param_bytes[v]} == {
        "0/addmm#0": (32 + 8) * 8, "2/addmm#0": (16 + 2) * 8}


def test_tied_weights_counted_once() -> None:
    model, _, g = captured("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    n_tensors = len(list(model.parameters()))
    assert Counter(g.op)["aten.addcdiv_.default"] == n_tensors  # one update per parameter tensor
    wte = model.transformer.wte.weight
    wte_bytes = wte.numel() * F32 * 4
    owner = [v for v in range(g.num_nodes) if g.param_bytes[v] == wte_bytes]
    assert len(owner) == 1 and g.kind[owner[0]] == "optimizer"
    assert g.group[owner[0]] == "transformer.wte/embedding#0"
    # both uses' gradients are accumulated in the backward pass, colocated with the embedding
    acc = [v for v in range(g.num_nodes) if g.kind[v] == "backward" and g.group[v] == "transformer.wte/embedding#0"]
    assert len(acc) >= 2


@pytest.mark.parametrize("name", list(MODELS))
def test_every_edge_carries_its_tensor_bytes(name: str) -> None:
    _, _, g = captured(name)
    assert g.num_edges > 0
    for e in range(g.num_edges):
        rec = g.edge_record(e)
        size = torch.empty((), dtype=getattr(torch, rec["dtype"])).element_size()
        assert rec["bytes"] == prod(rec["shape"]) * size, rec


def test_edges_and_output_bytes_of_a_small_mlp() -> None:
    _, _, g = captured("mlp")
    edges = {(g.ids[g.edge_src[e]], g.ids[g.edge_dst[e]]): int(g.edge_bytes[e]) for e in range(g.num_edges)}
    assert edges[("input/input", "0/addmm#0")] == 3 * 4 * F32
    assert edges[("0/addmm#0", "1/relu_#0")] == 3 * 8 * F32
    assert edges[("1/relu_#0", "2/addmm#0")] == 3 * 8 * F32  # consumers read the in-place op's value
    assert edges[("1/relu_#0", "1/threshold_backward#0")] == 3 * 8 * F32
    assert g.output_bytes[g.index["input/input"]] == 3 * 4 * F32
    assert g.output_bytes[g.index["0/addmm#0"]] == 3 * 8 * F32
    assert g.output_bytes[g.index["1/relu_#0"]] == 3 * 8 * F32  # rewrites an activation: a new value of it
    assert not any(g.op[v].startswith(("aten.t.", "aten.view", "aten.detach")) for v in range(g.num_nodes))
    upd = [v for v in range(g.num_nodes) if g.op[v] == "aten.addcdiv_.default"]
    assert all(g.output_bytes[v] == 0 for v in upd)  # writes a parameter: already in param_bytes


def test_views_fold_into_their_base() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(12, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(x).view(4, 12)  # a view of tanh's output
            y = y.unsqueeze(0)
            y.squeeze_(0)  # an in-place view op: metadata only
            return self.fc(y).transpose(0, 1).sum(0)

    g = capture(M(), torch.randn(2, 2, 12), optimizer="none")
    tanh = g.index["/tanh#0"]
    assert g.output_bytes[tanh] == 48 * F32
    consumers = {g.ids[g.edge_dst[e]]: int(g.edge_bytes[e]) for e in g.out_edges(tanh)}
    assert consumers["fc/addmm#0"] == 48 * F32  # the edge carries the base tensor, shape [2, 2, 12]
    assert not any(name in op for op in g.op for name in (".view.", ".transpose.", ".unsqueeze.", ".squeeze_."))
    assert Counter(g.op[v] for v in range(g.num_nodes) if g.kind[v] == "forward") == {
        "input": 1, "aten.tanh.default": 1, "aten.addmm.default": 1, "aten.sum.dim_IntList": 1, "aten.sum.default": 1}


# ----------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("name", list(MODELS))
def test_kinds_groups_and_order(name: str) -> None:
    _, _, g = captured(name)
    kinds = list(g.kind)
    assert set(kinds) == {"forward", "backward", "optimizer"}
    rank = {"forward": 0, "backward": 1, "optimizer": 2}
    assert [rank[k] for k in kinds] == sorted(rank[k] for k in kinds)  # forward, then backward, then optimizer
    forward_ops = {g.ids[v] for v in range(g.num_nodes) if g.kind[v] == "forward" and g.op[v] != "input"}
    for v in range(g.num_nodes):
        if g.kind[v] == "forward":
            assert g.group[v] == g.ids[v]
        else:
            assert g.group[v] in forward_ops, (g.ids[v], g.group[v])
            module = g.node_extra[g.index[g.group[v]]]["module"]
            if g.kind[v] == "backward":
                assert _extra(g, v, "module") == module
    assert all(g.edge_src[e] < g.edge_dst[e] for e in range(g.num_edges))  # recorded in execution order
    assert len(g.topo_order) == g.num_nodes
    for v in range(g.num_nodes):
        if g.op[v] != "input":
            assert g.node_extra[v]["sig"]["target"] == g.op[v]
            assert g.ids[v].startswith(_extra(g, v, "module") + "/")


def test_backward_groups_follow_the_forward_op() -> None:
    _, _, g = captured("cnn")
    assert g.group[g.index["dw/convolution_backward#0"]] == "dw/convolution#0"
    assert g.group[g.index["head/mm#0"]] == "head/addmm#0"
    bn = [g.ids[v] for v in range(g.num_nodes) if g.op[v] == "aten.native_batch_norm_backward.default"]
    assert [g.group[g.index[b]] for b in bn] == ["bn2/_native_batch_norm_legit#0", "bn1/_native_batch_norm_legit#0"]
    opt_groups = {g.group[v] for v in range(g.num_nodes) if g.kind[v] == "optimizer"}
    assert opt_groups == {"stem/convolution#0", "bn1/_native_batch_norm_legit#0", "dw/convolution#0",
                          "bn2/_native_batch_norm_legit#0", "pw/convolution#0", "head/addmm#0"}


def test_graph_metadata_and_hf_loss() -> None:
    _, _, g = captured("gpt2")
    cap = g.meta["capture"]
    assert cap["frontend"] == "torch" and cap["torch"] == torch.__version__
    assert (cap["model"], cap["batch"], cap["optimizer"], cap["dtype"]) == ("GPT2LMHeadModel", 2, "adam", "float32")
    assert g.name == "GPT2LMHeadModel-b2"
    last_forward = max(v for v in range(g.num_nodes) if g.kind[v] == "forward")
    assert g.op[last_forward] == "aten.nll_loss_forward.default"  # the model's own loss (labels given)
    assert {g.ids[v] for v in range(g.num_nodes) if g.op[v] == "input"} == {"input/input_ids"}  # labels is ids


def test_capture_is_deterministic() -> None:
    torch.manual_seed(0)
    model, inputs = _gpt2()
    a = capture(model, inputs).to_dict()
    b = capture(model, inputs).to_dict()
    assert a == b


def test_model_is_left_untouched() -> None:
    model, x = _cnn()
    params = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, x)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_meta_and_fake_models_give_the_same_graph() -> None:
    torch.manual_seed(0)
    real = capture(*_mlp()).to_dict()
    with torch.device("meta"):
        meta_model, meta_x = _mlp()
    assert capture(meta_model, meta_x).to_dict() == real
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_model, fake_x = _mlp()
    assert capture(fake_model, fake_x).to_dict() == real
    assert all(p.grad is None for p in fake_model.parameters())


def test_errors() -> None:
    model, x = _mlp()
    with pytest.raises(CaptureError, match="unknown optimizer"):
        capture(model, x, optimizer="lamb")

    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return y[y > 0]

    with pytest.raises(CaptureError, match="depends on tensor values"):
        capture(DataDependent(), x)
    with pytest.raises(CaptureError, match="no floating-point tensor"):
        capture(nn.Sequential(nn.Flatten()), x)


def test_gradients_are_counted_once_in_param_bytes_not_as_backward_outputs() -> None:
    _, _, g = captured("mlp")
    # the weight gradient of the last Linear (8 -> 2) is an mm in backward; it lives in .grad, counted in
    # param_bytes, so that mm allocates nothing more
    grads = [v for v in range(g.num_nodes) if g.kind[v] == "backward" and g.op[v] == "aten.mm.default"
             and any(int(g.edge_bytes[e]) == 2 * 8 * F32 for e in g.out_edges(v))]
    assert grads and all(g.output_bytes[v] == 0 for v in grads)
    # the activation gradient flowing back (3 x 8) is still allocated
    act = [v for v in range(g.num_nodes) if g.kind[v] == "backward" and g.op[v] == "aten.mm.default"
           and any(int(g.edge_bytes[e]) == 3 * 8 * F32 for e in g.out_edges(v))]
    assert act and all(g.output_bytes[v] == 3 * 8 * F32 for v in act)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("amp", [False, True])
def test_optimizer_state_made_without_a_warm_up_step_records_the_same_step(monkeypatch, optimizer, amp):
    import json

    import devplace.capture.torch_capture as tc

    def step_of() -> str:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
        dtype = "bf16" if amp else None
        if amp:
            model = model.to(torch.bfloat16)
        g = capture(model, (torch.randn(4, 16),), optimizer=optimizer, amp=amp, dtype=dtype)
        return json.dumps(g.to_dict())

    made = step_of()
    monkeypatch.setattr(tc, "_fresh_state", lambda opt: False)  # the state from an unrecorded warm-up step
    assert made == step_of()
