"""Zoo models and the study's graph families: they build offline, under FakeTensorMode, train for one step, and
the families are reproducible per (family, index)."""

from __future__ import annotations

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from devplace.capture import capture
from devplace.errors import DevplaceError
from devplace.zoo.families import FAMILIES, FAMILY_SIZE, family_arch, family_model
from devplace.zoo.models import GNMT, MODELS, build_model, get_spec, model_names

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# only constructed under fake mode: a forward+backward of these takes too long
BIG = {"gpt2-xl", "llama-1b", "llama3-8b", "llama-13b", "gpt3-1.3b"}


def _param_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()]


def test_registry_names_and_specs():
    assert model_names() == ["inception_v3", "resnet50", "vgg16", "mobilenet_v3_large", "bert-base", "gpt2",
                             "gpt2-xl", "t5-small", "llama-1b", "llama3-8b", "llama-13b", "gpt3-1.3b", "gnmt"]
    for name, spec in MODELS.items():
        assert spec.name == name and spec.batch >= 1 and spec.params > 0
        assert (spec.seq_len is None) == (spec.source == "torchvision")
        assert "parameters" in spec.description
    with pytest.raises(DevplaceError, match="unknown zoo model"):
        get_spec("gpt5")
    with pytest.raises(DevplaceError, match="images"):
        build_model("resnet50", seq_len=128)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_builds_and_trains_under_fake_mode(name):
    spec = MODELS[name]
    with FakeTensorMode():
        module, inputs, loss_fn = spec.build()
        assert loss_fn is None and module.training
        params = list(module.parameters())
        assert all(isinstance(p, FakeTensor) for p in params)
        assert sum(p.numel() for p in params) == spec.params  # the description's count is the real one
        assert all(isinstance(x, FakeTensor) for x in inputs)
        assert inputs[0].shape[0] == spec.batch
        if spec.seq_len is not None:
            assert inputs[0].shape[1] == spec.seq_len
        if name in BIG:
            return
        loss = module(*inputs)
        assert loss.shape == ()
        loss.backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in params if p.requires_grad)


def test_batch_and_seq_len_override():
    with FakeTensorMode():
        _, inputs, _ = build_model("gpt2", batch=2, seq_len=64)
        assert tuple(inputs[0].shape) == (2, 64)
        _, inputs, _ = build_model("t5-small", batch=3, seq_len=16)
        assert [tuple(x.shape) for x in inputs] == [(3, 16), (3, 16)]
        _, inputs, _ = build_model("inception_v3", batch=1)
        assert tuple(inputs[0].shape) == (1, 3, 299, 299)
    with pytest.raises(DevplaceError, match="1024 positions"):
        build_model("gpt2", seq_len=2048)
    with pytest.raises(DevplaceError, match="2048 positions"):  # GPT-3's context, not GPT-2's
        build_model("gpt3-1.3b", seq_len=2049)


def test_build_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, _, _ = build_model("mobilenet_v3_large", batch=1, seed=3)
    b, _, _ = build_model("mobilenet_v3_large", batch=1, seed=3)
    c, _, _ = build_model("mobilenet_v3_large", batch=1, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    wa, wb, wc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_small_gnmt_real_step():
    torch.manual_seed(0)
    model = GNMT(vocab=50, hidden=16, enc_layers=3, dec_layers=3)
    src, tgt_in, tgt_out = (torch.randint(0, 50, (2, 7)) for _ in range(3))
    loss = model(src, tgt_in, tgt_out)
    loss.backward()
    assert torch.isfinite(loss) and model.encoder[0].weight_ih_l0.grad is not None


# ------------------------------------------------------------------------------------------------ families

def test_family_arch_is_reproducible_and_varies():
    for fam in FAMILIES:
        archs = [family_arch(fam, i) for i in range(FAMILY_SIZE)]
        assert archs == [family_arch(fam, i) for i in range(FAMILY_SIZE)]
        distinct = {repr({k: v for k, v in a.items() if k != "index"}) for a in archs}
        assert len(distinct) == FAMILY_SIZE, fam  # different indices give different architectures
    with pytest.raises(DevplaceError, match="unknown graph family"):
        family_arch("imagenet", 0)
    with pytest.raises(DevplaceError, match="index"):
        family_arch("ptb", -1)


def test_family_arch_ranges():
    for i in range(FAMILY_SIZE):
        cnn = family_arch("cifar10", i)
        assert 3 <= cnn["num_layers"] <= 9 and len(cnn["normal"]) == len(cnn["reduce"]) == 5
        for cell in (cnn["normal"], cnn["reduce"]):
            for b, (x_id, _, y_id, _) in enumerate(cell):
                assert 0 <= x_id < b + 2 and 0 <= y_id < b + 2
        rnn = family_arch("ptb", i)
        assert 5 <= rnn["nodes"] <= 12 and rnn["prev"][0] is None
        assert all(0 <= p < node for node, p in enumerate(rnn["prev"]) if node > 0)
        nmt = family_arch("nmt", i)
        assert 1 <= nmt["enc_layers"] <= 4 and 1 <= nmt["dec_layers"] <= 4


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_model_is_deterministic(fam):
    with FakeTensorMode():
        a = _param_shapes(family_model(fam, 5)[0])
        b = _param_shapes(family_model(fam, 5)[0])
        c = _param_shapes(family_model(fam, 6)[0])
    assert a == b
    assert a != c
    m1, m2 = family_model(fam, 1, batch=1, seq_len=None if fam == "cifar10" else 2)[0], \
        family_model(fam, 1, batch=1, seq_len=None if fam == "cifar10" else 2)[0]
    assert repr(m1) == repr(m2)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))


@pytest.mark.parametrize(("fam", "index", "seq_len"), [("cifar10", 0, None), ("ptb", 0, None), ("nmt", 0, 6)])
def test_family_member_real_step(fam, index, seq_len):
    module, inputs, loss_fn = family_model(fam, index, batch=2, seq_len=seq_len)
    assert loss_fn is None
    loss = module(*inputs)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())
    if fam == "ptb":
        assert inputs[0].shape == (2, 35)  # unrolled over the study's 35 steps


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_member_under_fake_mode_default_size(fam):
    with FakeTensorMode():
        module, inputs, _ = family_model(fam, 3)
        assert all(isinstance(p, FakeTensor) for p in module.parameters())
        module(*inputs).backward()


def test_family_overrides():
    with pytest.raises(DevplaceError, match="images"):
        family_model("cifar10", 0, seq_len=10)
    with FakeTensorMode():
        _, inputs, _ = family_model("nmt", 2, batch=4, seq_len=9)
    assert [tuple(x.shape) for x in inputs] == [(4, 9)] * 3


# ------------------------------------------------------------------------------------------------ capture

@pytest.mark.parametrize("fam", FAMILIES)
def test_capture_one_family_member(fam):
    module, inputs, loss_fn = family_model(fam, 0, batch=2, seq_len=None if fam == "cifar10" else 4)
    graph = capture(module, inputs, loss_fn=loss_fn)
    assert graph.num_nodes > 0
    assert {"forward", "backward"} <= set(graph.kind)


def test_capture_small_gpt2():
    module, inputs, loss_fn = build_model("gpt2", batch=1, seq_len=16)
    graph = capture(module, inputs, loss_fn=loss_fn)
    assert {"forward", "backward"} <= set(graph.kind)
