"""The seed study's three graph families, rebuilt as seeded PyTorch model generators.

Placeto and the seed study used three families of 32 TensorFlow graphs each, generated with ENAS (Pham et al.
2018): `cifar10` (CNNs from ENAS's micro search space), `ptb` (RNN language models whose recurrent cell is an
ENAS-style random DAG) and `nmt` (encoder-decoders with attention). devplace rebuilds the same kinds of models
in PyTorch so that their training graphs can be captured:

    module, inputs, loss_fn = family_model("cifar10", 7)   # loss = module(*inputs); loss_fn is None

Graph `index` of a family draws every architecture choice from `numpy.random.Generator(PCG64([crc32(family),
index]))`, and seeds torch's weight initialisation from the same pair, so the same (family, index) gives the
same module on every machine and run, independently of any other index. The study's families are indices
0..31; any index >= 0 is a valid further member. docs/zoo.md lists the ranges and the sizes they give.

The module contract is the zoo's (see `devplace.zoo.models`): `module(*inputs)` returns the scalar training
loss, construction and inputs are shape-only so everything works under `FakeTensorMode`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from devplace.errors import DevplaceError

FAMILIES: tuple[str, ...] = ("cifar10", "ptb", "nmt")
FAMILY_SIZE = 32  # graphs per family in the seed study (indices 0..31)

# Generator ranges (documented in docs/zoo.md; change both together).
CIFAR10_NUM_LAYERS = (3, 9)  # ENAS `num_layers`: the network has num_layers + 2 cells, 2 of them reductions
CIFAR10_CHANNELS = (16, 20, 24, 32, 36)  # ENAS `out_filters` of the first stage (doubled at each reduction)
CIFAR10_CELL_NODES = 5  # B
CIFAR10_OPS = ("sep_conv_3x3", "sep_conv_5x5", "avg_pool_3x3", "max_pool_3x3", "identity")
CIFAR10_BATCH = 32

PTB_NODES = (5, 12)  # nodes of the recurrent cell's DAG
PTB_HIDDEN = (256, 384, 512, 640, 720)  # hidden = embedding size (tied embedding and softmax weights)
PTB_ACTIVATIONS = ("tanh", "relu", "sigmoid", "identity")
PTB_VOCAB = 10000
PTB_BATCH = 20
PTB_STEPS = 35

NMT_ENC_LAYERS = (1, 4)
NMT_DEC_LAYERS = (1, 4)
NMT_HIDDEN = (256, 384, 512, 768, 1024)
NMT_VOCAB = (8000, 16000, 32000)
NMT_ATTENTION = ("dot", "general", "additive")
NMT_BATCH = 32
NMT_STEPS = 30  # source and target length


def _check(name: str, index: int) -> None:
    if name not in FAMILIES:
        raise DevplaceError(f"unknown graph family {name!r}; known families: {', '.join(FAMILIES)}")
    if not isinstance(index, int | np.integer) or index < 0:
        raise DevplaceError(f"family index must be an integer >= 0 (the study uses 0..{FAMILY_SIZE - 1}), "
                            f"got {index!r}")


def family_rng(name: str, index: int) -> np.random.Generator:
    """The architecture RNG of graph `index` of family `name`: depends on (name, index) only."""
    return np.random.Generator(np.random.PCG64([zlib.crc32(name.encode()), int(index)]))


def _torch_seed(name: str, index: int) -> int:
    return (zlib.crc32(name.encode()) * 1_000_003 + int(index)) % (2**63)


# ------------------------------------------------------------------------------------------ architectures

def family_arch(name: str, index: int) -> dict[str, Any]:
    """The architecture choices of graph `index` of family `name`, as a JSON-able dict (graph metadata)."""
    _check(name, index)
    rng = family_rng(name, index)
    arch: dict[str, Any] = {"family": name, "index": int(index)}
    if name == "cifar10":
        arch["num_layers"] = int(rng.integers(CIFAR10_NUM_LAYERS[0], CIFAR10_NUM_LAYERS[1] + 1))
        arch["channels"] = int(rng.choice(CIFAR10_CHANNELS))
        arch["normal"] = _sample_cell(rng)
        arch["reduce"] = _sample_cell(rng)
    elif name == "ptb":
        nodes = int(rng.integers(PTB_NODES[0], PTB_NODES[1] + 1))
        arch["hidden"] = int(rng.choice(PTB_HIDDEN))
        arch["nodes"] = nodes
        arch["activations"] = [PTB_ACTIVATIONS[int(a)] for a in rng.integers(0, len(PTB_ACTIVATIONS), nodes)]
        arch["prev"] = [None] + [int(rng.integers(0, node)) for node in range(1, nodes)]
    else:
        arch["enc_layers"] = int(rng.integers(NMT_ENC_LAYERS[0], NMT_ENC_LAYERS[1] + 1))
        arch["dec_layers"] = int(rng.integers(NMT_DEC_LAYERS[0], NMT_DEC_LAYERS[1] + 1))
        arch["hidden"] = int(rng.choice(NMT_HIDDEN))
        arch["vocab"] = int(rng.choice(NMT_VOCAB))
        arch["bidirectional"] = bool(rng.integers(0, 2))
        arch["attention"] = NMT_ATTENTION[int(rng.integers(0, len(NMT_ATTENTION)))]
    return arch


def _sample_cell(rng: np.random.Generator) -> list[list[Any]]:
    """B nodes; node b takes inputs x, y among the cell's two inputs (0, 1) and nodes before it (2..b+1),
    each through an op; [x_id, x_op, y_id, y_op] per node."""
    cell = []
    for b in range(CIFAR10_CELL_NODES):
        x_id, y_id = (int(v) for v in rng.integers(0, b + 2, 2))
        x_op, y_op = (CIFAR10_OPS[int(v)] for v in rng.integers(0, len(CIFAR10_OPS), 2))
        cell.append([x_id, x_op, y_id, y_op])
    return cell


# ------------------------------------------------------------------------------------ cifar10: ENAS micro

class ReLUConvBN(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, kernel: int = 1, stride: int = 1):
        super().__init__(nn.ReLU(), nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False),
                         nn.BatchNorm2d(c_out))


class FactorizedReduce(nn.Module):
    """Halve height and width without losing every other pixel: two 1x1 stride-2 convolutions, the second on
    the input shifted by one pixel, each giving half the output channels, concatenated, batch-normed."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out // 2, 1, 2, bias=False)
        self.conv2 = nn.Conv2d(c_in, c_out - c_out // 2, 1, 2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.conv1(x), self.conv2(shifted)], dim=1))


class SepConv(nn.Sequential):
    """ENAS's separable convolution, stacked twice: (ReLU, depthwise k x k, pointwise 1x1, BN) x 2."""

    def __init__(self, c: int, kernel: int, stride: int):
        layers: list[nn.Module] = []
        for i in range(2):
            layers += [nn.ReLU(), nn.Conv2d(c, c, kernel, stride if i == 0 else 1, kernel // 2, groups=c, bias=False),
                       nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)]
        super().__init__(*layers)


def _cell_op(name: str, c: int, stride: int) -> nn.Module:
    if name == "sep_conv_3x3":
        return SepConv(c, 3, stride)
    if name == "sep_conv_5x5":
        return SepConv(c, 5, stride)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride, 1, count_include_pad=False)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride, 1)
    return nn.Identity() if stride == 1 else FactorizedReduce(c, c)


class MicroCell(nn.Module):
    """One ENAS micro cell. Its two inputs (the outputs of the two previous cells) are first brought to `c`
    channels and the same size; each node sums its two op outputs; the cell's output concatenates the loose
    ends (states no node reads). In a reduction cell the ops reading the cell inputs have stride 2."""

    def __init__(self, arc: list[list[Any]], c_pp: int, c_p: int, c: int, reduction: bool, prev_reduced: bool):
        super().__init__()
        self.arc = [tuple(node) for node in arc]
        self.pre0 = FactorizedReduce(c_pp, c) if prev_reduced else ReLUConvBN(c_pp, c)
        self.pre1 = ReLUConvBN(c_p, c)
        self.ops = nn.ModuleList()
        used = set()
        for x_id, x_op, y_id, y_op in self.arc:
            for i, op in ((x_id, x_op), (y_id, y_op)):
                self.ops.append(_cell_op(op, c, 2 if reduction and i < 2 else 1))
                used.add(i)
        self.loose = [i for i in range(len(self.arc) + 2) if i not in used]
        # A loose cell input of a reduction cell is still full size: reduce it like ENAS's final combine.
        self.calibrate = nn.ModuleDict({str(i): FactorizedReduce(c, c) for i in self.loose if reduction and i < 2})
        self.c_out = c * len(self.loose)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.pre0(s0), self.pre1(s1)]
        for b, (x_id, _, y_id, _) in enumerate(self.arc):
            states.append(self.ops[2 * b](states[x_id]) + self.ops[2 * b + 1](states[y_id]))
        outs = [self.calibrate[str(i)](states[i]) if str(i) in self.calibrate else states[i] for i in self.loose]
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


class EnasMicroCNN(nn.Module):
    """ENAS micro network for CIFAR-10: a 3x3 stem (3c channels), num_layers + 2 cells with reduction cells at
    positions num_layers // 3 and 2 * (num_layers // 3) + 1 (channels doubled there), ReLU, global average
    pooling, dropout, a 10-way classifier; loss = cross-entropy with the given labels."""

    def __init__(self, arch: dict[str, Any], classes: int = 10):
        super().__init__()
        n, c = arch["num_layers"], arch["channels"]
        self.stem = nn.Sequential(nn.Conv2d(3, 3 * c, 3, 1, 1, bias=False), nn.BatchNorm2d(3 * c))
        pool_layers = {n // 3, 2 * (n // 3) + 1}
        self.cells = nn.ModuleList()
        c_pp = c_p = 3 * c
        prev_reduced = False
        for layer in range(n + 2):
            reduction = layer in pool_layers
            if reduction:
                c *= 2
            cell = MicroCell(arch["reduce" if reduction else "normal"], c_pp, c_p, c, reduction, prev_reduced)
            self.cells.append(cell)
            c_pp, c_p, prev_reduced = c_p, cell.c_out, reduction
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(c_p, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(images)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        x = F.adaptive_avg_pool2d(F.relu(s1), 1).flatten(1)
        return F.cross_entropy(self.classifier(self.dropout(x)), labels)


# ----------------------------------------------------------------------------------------- ptb: ENAS RNN

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid, "identity": lambda x: x}


class EnasRNNCell(nn.Module):
    """ENAS recurrent cell: node 0 reads [x_t; h_{t-1}], node l > 0 reads one earlier node j; each node computes
    (c, g) = split(W s_in), s = s_in + sigmoid(g) * (act(c) - s_in) (a highway step, s_in = h_{t-1} for node 0);
    h_t = mean of the loose ends (nodes no other node reads)."""

    def __init__(self, hidden: int, activations: list[str], prev: list[int | None]):
        super().__init__()
        self.activations = list(activations)
        self.prev = list(prev)
        self.w0 = nn.Linear(2 * hidden, 2 * hidden, bias=False)
        self.w = nn.ModuleList([nn.Linear(hidden, 2 * hidden, bias=False) for _ in range(len(prev) - 1)])
        used = {p for p in prev if p is not None}
        self.loose = [i for i in range(len(prev)) if i not in used]

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        c, g = self.w0(torch.cat([x, h], dim=1)).chunk(2, dim=1)
        states = [h + torch.sigmoid(g) * (_ACTIVATIONS[self.activations[0]](c) - h)]
        for node in range(1, len(self.prev)):
            s_in = states[self.prev[node]]
            c, g = self.w[node - 1](s_in).chunk(2, dim=1)
            states.append(s_in + torch.sigmoid(g) * (_ACTIVATIONS[self.activations[node]](c) - s_in))
        if len(self.loose) == 1:
            return states[self.loose[0]]
        return torch.stack([states[i] for i in self.loose]).mean(dim=0)


class EnasRNNLM(nn.Module):
    """Word-level LM: embedding (tied with the softmax), the ENAS cell unrolled over the sequence by a Python
    loop (so a captured graph holds one copy of the cell per step), dropout, cross-entropy with the targets."""

    def __init__(self, arch: dict[str, Any], vocab: int = PTB_VOCAB, dropout: float = 0.25):
        super().__init__()
        self.vocab = vocab
        self.embedding = nn.Embedding(vocab, arch["hidden"])
        self.cell = EnasRNNCell(arch["hidden"], arch["activations"], arch["prev"])
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.embedding(tokens))
        h, outs = h0, []
        for t in range(tokens.shape[1]):
            h = self.cell(x[:, t], h)
            outs.append(h)
        logits = F.linear(self.dropout(torch.stack(outs, dim=1)), self.embedding.weight)
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


# ----------------------------------------------------------------------------- nmt: LSTM seq2seq + attention

class Seq2SeqAttention(nn.Module):
    """LSTM encoder-decoder with global attention (Luong et al. 2015), both unrolled by Python loops.
    Encoder: enc_layers LSTM layers of `hidden` units (the first optionally bidirectional, hidden/2 per
    direction). Decoder: dec_layers LSTM layers, layer l starting from encoder layer l's final state (zeros
    beyond); input feeding (the previous attentional vector joins the embedding); at each step the top layer
    attends over the encoder outputs (`dot`, `general` or `additive` score), attentional vector
    tanh(W [context; h]); a softmax over the target vocabulary; cross-entropy with the targets."""

    def __init__(self, arch: dict[str, Any], dropout: float = 0.2):
        super().__init__()
        h, vocab = arch["hidden"], arch["vocab"]
        self.vocab, self.hidden, self.attention = vocab, h, arch["attention"]
        self.bidirectional = arch["bidirectional"]
        self.dropout = nn.Dropout(dropout)
        self.src_embedding = nn.Embedding(vocab, h)
        self.tgt_embedding = nn.Embedding(vocab, h)
        first = h // 2 if self.bidirectional else h
        self.encoder = nn.ModuleList([nn.LSTMCell(h, first)] + [nn.LSTMCell(h, h)
                                                                 for _ in range(arch["enc_layers"] - 1)])
        self.encoder_bw = nn.LSTMCell(h, h - first) if self.bidirectional else None
        self.decoder = nn.ModuleList([nn.LSTMCell(2 * h, h)] + [nn.LSTMCell(h, h)
                                                                 for _ in range(arch["dec_layers"] - 1)])
        if self.attention == "general":
            self.w_score = nn.Linear(h, h, bias=False)
        elif self.attention == "additive":
            self.w_query = nn.Linear(h, h, bias=False)
            self.w_key = nn.Linear(h, h, bias=True)
            self.v = nn.Linear(h, 1, bias=False)
        self.w_out = nn.Linear(2 * h, h, bias=False)
        self.classifier = nn.Linear(h, vocab)

    @staticmethod
    def _run(cell: nn.LSTMCell, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        state = None
        outs = []
        for x in xs:
            state = cell(x, state)
            outs.append(state[0])
        assert state is not None
        return outs, state

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        emb = self.dropout(self.src_embedding(src))
        xs = [emb[:, t] for t in range(src.shape[1])]
        finals = []
        for i, cell in enumerate(self.encoder):
            outs, state = self._run(cell, xs)
            if i == 0 and self.encoder_bw is not None:
                bw, bw_state = self._run(self.encoder_bw, xs[::-1])
                outs = [torch.cat([f, b], dim=1) for f, b in zip(outs, bw[::-1], strict=True)]
                state = (torch.cat([state[0], bw_state[0]], dim=1), torch.cat([state[1], bw_state[1]], dim=1))
            finals.append(state)
            xs = [self.dropout(o) for o in outs] if i + 1 < len(self.encoder) else outs
        return torch.stack(xs, dim=1), finals

    def _attend(self, query: torch.Tensor, memory: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        if self.attention == "additive":
            assert keys is not None
            scores = self.v(torch.tanh(keys + self.w_query(query).unsqueeze(1))).squeeze(2)
        else:
            q = self.w_score(query) if self.attention == "general" else query
            scores = torch.bmm(memory, q.unsqueeze(2)).squeeze(2)
        return torch.bmm(F.softmax(scores, dim=1).unsqueeze(1), memory).squeeze(1)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        memory, finals = self.encode(src)
        keys = self.w_key(memory) if self.attention == "additive" else None
        emb = self.dropout(self.tgt_embedding(tgt_in))
        states: list[tuple[torch.Tensor, ...] | None] = [finals[i] if i < len(finals) else None
                                                         for i in range(len(self.decoder))]
        feed = memory.new_zeros(src.shape[0], self.hidden)
        outs = []
        for t in range(tgt_in.shape[1]):
            x = torch.cat([emb[:, t], feed], dim=1)
            for i, cell in enumerate(self.decoder):
                states[i] = cell(x if i == 0 else self.dropout(x), states[i])
                x = states[i][0]
            context = self._attend(x, memory, keys)
            feed = torch.tanh(self.w_out(torch.cat([context, x], dim=1)))
            outs.append(feed)
        logits = self.classifier(self.dropout(torch.stack(outs, dim=1)))
        return F.cross_entropy(logits.reshape(-1, self.vocab), tgt_out.reshape(-1))


# ------------------------------------------------------------------------------------------------ public

def family_defaults(name: str) -> tuple[int, int | None]:
    """(default batch, default sequence length or None for images) of a family."""
    _check(name, 0)
    return {"cifar10": (CIFAR10_BATCH, None), "ptb": (PTB_BATCH, PTB_STEPS), "nmt": (NMT_BATCH, NMT_STEPS)}[name]


def family_model(name: str, index: int, *, batch: int | None = None,
                 seq_len: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...], None]:
    """(module, example_inputs, loss_fn=None) of graph `index` of family `name` ("cifar10", "ptb", "nmt"):
    `module(*example_inputs)` is the training loss. Defaults: cifar10 batch 32 of 32x32 images; ptb batch 20,
    35 steps; nmt batch 32, 30 source and 30 target steps."""
    arch = family_arch(name, index)
    default_batch, default_len = family_defaults(name)
    batch = default_batch if batch is None else int(batch)
    if batch < 1:
        raise DevplaceError(f"batch must be at least 1, got {batch}")
    if default_len is None and seq_len is not None:
        raise DevplaceError(f"family {name!r} takes 32x32 images, not sequences: drop seq_len")
    steps = default_len if seq_len is None else int(seq_len)
    if steps is not None and steps < 1:
        raise DevplaceError(f"seq_len must be at least 1, got {steps}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_torch_seed(name, index))
        module: nn.Module
        if name == "cifar10":
            module = EnasMicroCNN(arch)
            inputs: tuple[torch.Tensor, ...] = (torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))
        elif name == "ptb":
            assert steps is not None
            module = EnasRNNLM(arch)
            inputs = (torch.randint(0, PTB_VOCAB, (batch, steps)), torch.randint(0, PTB_VOCAB, (batch, steps)),
                      torch.zeros(batch, arch["hidden"]))
        else:
            assert steps is not None
            module = Seq2SeqAttention(arch)
            inputs = tuple(torch.randint(0, arch["vocab"], (batch, steps)) for _ in range(3))
    module.train()
    return module, inputs, None
