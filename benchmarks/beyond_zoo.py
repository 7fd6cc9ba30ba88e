"""Beyond the zoo (issue 11, item 6): the zoo and models that are not in it, each on a cluster where it does
not fit one device and on one where it does.

For each (model, cluster) the captured training step is costed for the cluster's device and coarsened to
`--max-nodes` groups; every placer runs through `place_expanded` (what `devplace.plan` and `devplace place
--model` use: the autograd rule, the full graph checked as run). The script re-simulates every returned
placement as autograd runs it (`runtime_placement`) and prints "placed = as run" only when the two step
times are equal, "OVER MEMORY AS RUN" when the full graph is over memory. Per row: the best single device (or
"does not fit" and the memory the step needs on one device), the `even` split (accelerate's `balanced`
map by compute), the best optimising placer and its ratio to even (< 1: faster), the placement time of that
placer (wall clock of `place_expanded`), and every placer's step time ("@N": placed on a finer coarsening of
N groups, as `place_expanded` does when the given one fits nowhere).

Models outside the zoo are built here, on the meta device (shapes only; capture runs on fake tensors):
torchvision ViT-B/16, ConvNeXt-Tiny, Swin-T, EfficientNet-B0; transformers configs written in code (never
downloaded: HF_HUB_OFFLINE=1) for a 1.35B Llama-style decoder, BART-base, T5-base, CLIP-B/16 (contrastive
loss), a Mixtral-style and a Qwen2-MoE-style decoder; and a two-tower recommender with a 1B-parameter user
embedding. Captured graphs are cached as devplace.graph/1 JSON under `--cache` (default
/tmp/devplace-beyond-zoo), so a rerun only costs, coarsens and places.

Run: `.venv/bin/python benchmarks/beyond_zoo.py [--models vit_b_16,two-tower] [--placers m-etf,m-sct]
[--max-nodes 250]`. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are written below; nothing may be downloaded

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from devplace.capture.pipeline import capture_zoo_model, prepare
from devplace.capture.torch_capture import capture
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.graph.io import load_graph, save_graph
from devplace.graph.placement import runtime_placement
from devplace.hardware.presets import PRESETS
from devplace.placers import place_expanded
from devplace.sim import simulate
from devplace.sim.devplace_model import DevplaceModel
from devplace.units import fmt_bytes, fmt_time

SMALL, BIG = "4xV100-16GB", "4xH100-80GB-NVLink"
PLACERS = "m-etf,m-sct,heft,m-topo,contiguous,greedy,partition,even-refine"
Factory = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]


# ------------------------------------------------------------------------------------- models not in the zoo

class ImageLoss(nn.Module):
    """images, labels -> cross-entropy of a torchvision classifier."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels)


class HFLoss(nn.Module):
    """keyword inputs -> the transformers model's own `.loss`."""

    def __init__(self, model: nn.Module, **fixed: object):
        super().__init__()
        self.model = model
        self.fixed = fixed

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        names = {1: ("input_ids",), 2: ("input_ids", "labels")}[len(args)]
        return self.model(**dict(zip(names, args, strict=True)), **self.fixed).loss


class CLIPLoss(nn.Module):
    """token ids, images -> CLIP's symmetric contrastive loss (the two towers are parallel branches)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


class TwoTower(nn.Module):
    """A two-tower recommender with 1B embedding parameters: a user tower (3.9M user ids x 128, then an MLP)
    and an item tower (3.9M item ids x 128, then an MLP), scored by a dot product with in-batch negatives.
    Each table with its Adam state is 8 GB, so the two towers fit on two 16 GB devices and not on one."""

    def __init__(self, users: int = 3_906_250, items: int = 3_906_250, dim: int = 128, hidden: int = 1024):
        super().__init__()
        self.user_emb = nn.Embedding(users, dim)
        self.item_emb = nn.Embedding(items, dim)

        def tower() -> nn.Sequential:
            return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.user_tower, self.item_tower = tower(), tower()

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u = self.user_tower(self.user_emb(users))
        v = self.item_tower(self.item_emb(items))
        logits = u @ v.t()
        return F.cross_entropy(logits, torch.arange(logits.shape[0], device=logits.device))


def _tv(name: str, batch: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import torchvision

        return (ImageLoss(getattr(torchvision.models, name)(weights=None)),
                (torch.randn(batch, 3, 224, 224), torch.zeros(batch, dtype=torch.long)))
    return build


def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def _llama_135b(batch: int, seq: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import transformers as tf

        # 28 layers of hidden 2048, SwiGLU 5632, 32 query / 4 key-value heads, vocab 32000, untied: 1.35B
        config = tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=28,
                                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                                tie_word_embeddings=False, attn_implementation="sdpa")
        ids = _tokens(32000, batch, seq)
        return HFLoss(tf.LlamaForCausalLM(config), use_cache=False), (ids, ids)
    return build


def _bart_base(batch: int, seq: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import transformers as tf

        config = tf.BartConfig(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6,
                               encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                               decoder_ffn_dim=3072, max_position_embeddings=1024, attn_implementation="sdpa")
        return (HFLoss(tf.BartForConditionalGeneration(config), use_cache=False),
                (_tokens(50265, batch, seq), _tokens(50265, batch, seq)))
    return build


def _t5_base(batch: int, seq: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import transformers as tf

        config = tf.T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
                              decoder_start_token_id=0, pad_token_id=0)
        return (HFLoss(tf.T5ForConditionalGeneration(config), use_cache=False),
                (_tokens(32128, batch, seq), _tokens(32128, batch, seq)))
    return build


def _clip_b16(batch: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import transformers as tf

        config = tf.CLIPConfig(
            text_config={"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                         "num_attention_heads": 8, "max_position_embeddings": 77, "vocab_size": 49408},
            vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                           "num_attention_heads": 12, "image_size": 224, "patch_size": 16},
            projection_dim=512)
        return CLIPLoss(tf.CLIPModel(config)), (_tokens(49408, batch, 77), torch.randn(batch, 3, 224, 224))
    return build


def _mixtral(batch: int, seq: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import transformers as tf

        config = tf.MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                                  num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                                  num_experts_per_tok=2, max_position_embeddings=4096, attn_implementation="sdpa")
        ids = _tokens(32000, batch, seq)
        return HFLoss(tf.MixtralForCausalLM(config), use_cache=False), (ids, ids)
    return build


def _qwen2_moe(batch: int, seq: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        import transformers as tf

        config = tf.Qwen2MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                   moe_intermediate_size=704, shared_expert_intermediate_size=2816,
                                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                   num_experts=16, num_experts_per_tok=4, max_position_embeddings=4096,
                                   attn_implementation="sdpa")
        ids = _tokens(32000, batch, seq)
        return HFLoss(tf.Qwen2MoeForCausalLM(config), use_cache=False), (ids, ids)
    return build


def _two_tower(batch: int) -> Factory:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return TwoTower(), (torch.randint(0, 3_906_250, (batch,)), torch.randint(0, 3_906_250, (batch,)))
    return build


@dataclass(frozen=True)
class Case:
    """A model at a batch size; `factory` is None for a zoo model (`name` is then its zoo name)."""

    name: str
    batch: int
    factory: Factory | None = None
    dtype: str | None = None


# The batch of each model is chosen so that its step does not fit one 16 GB V100 (SMALL) and fits one 80 GB
# H100 (BIG); the table says which is the case for each row, measured, not assumed.
CASES = [Case("inception_v3", 256), Case("resnet50", 256), Case("vgg16", 256), Case("mobilenet_v3_large", 384),
         Case("bert-base", 128), Case("gpt2", 16), Case("gpt2-xl", 1), Case("t5-small", 192),
         Case("llama-1b", 1), Case("gnmt", 512),
         Case("vit_b_16", 128, _tv("vit_b_16", 128)), Case("convnext_tiny", 192, _tv("convnext_tiny", 192)),
         Case("swin_t", 160, _tv("swin_t", 160)), Case("efficientnet_b0", 256, _tv("efficientnet_b0", 256)),
         Case("llama-1.35b", 2, _llama_135b(2, 1024)), Case("bart-base", 24, _bart_base(24, 512)),
         Case("t5-base", 8, _t5_base(8, 512)), Case("clip-b16", 96, _clip_b16(96)),
         Case("mixtral-style", 8, _mixtral(8, 1024), "bf16"), Case("qwen2-moe-style", 16, _qwen2_moe(16, 1024), "bf16"),
         Case("two-tower", 8192, _two_tower(8192))]


def captured(case: Case, cache: Path) -> tuple[CompGraph, float]:
    """The captured (uncosted) step of `case`, from the cache when it is there; and the capture time (0 when
    cached)."""
    path = cache / f"{case.name}-b{case.batch}{'-' + case.dtype if case.dtype else ''}.json"
    if path.exists():
        return load_graph(path), 0.0
    t0 = time.perf_counter()
    if case.factory is None:
        graph = capture_zoo_model(case.name, batch=case.batch, dtype=case.dtype)
    else:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            torch.manual_seed(0)
            module, inputs = case.factory()
        module.train()
        graph = capture(module, inputs, optimizer="adam", name=f"{case.name}-b{case.batch}", dtype=case.dtype)
    elapsed = time.perf_counter() - t0
    cache.mkdir(parents=True, exist_ok=True)
    save_graph(graph, path)
    return graph, elapsed


def single_device(full: CompGraph, cluster_name: str) -> tuple[float | None, float]:
    """(step time on the fastest single device that holds the step or None, its peak memory there)."""
    cluster = PRESETS[cluster_name]()
    model = DevplaceModel(full, cluster)
    result = model.run(np.zeros(full.num_nodes, dtype=np.int64))  # the presets' devices are all alike
    return (result.step_time_s if result.feasible else None), float(result.peak_memory_bytes[0])


def run_case(case: Case, cluster_name: str, placers: list[str], max_nodes: int, cache: Path) -> str:
    graph, _ = captured(case, cache)
    cluster = PRESETS[cluster_name]()
    prep = prepare(graph, device=cluster.devices[0], max_nodes=max_nodes)
    full = prep.full
    one, need = single_device(full, cluster_name)
    fits_one = one is not None
    single_cell = fmt_time(one) if fits_one else f"does not fit (needs {fmt_bytes(need)})"
    times: dict[str, float] = {}
    cells: list[str] = []
    placement_s: dict[str, float] = {}
    bad: list[str] = []
    for placer in ["even", *placers]:
        t0 = time.perf_counter()
        try:
            out = place_expanded(prep.coarsening, full, cluster, placer=placer)
        except DevplaceError as exc:
            cells.append(f"{placer} {type(exc).__name__}")
            continue
        placement_s[placer] = time.perf_counter() - t0
        as_run = simulate(full, cluster, runtime_placement(full, out.placement))
        if as_run.step_time_s != out.result.step_time_s:
            bad.append(f"{placer}: placed {fmt_time(out.result.step_time_s)} != as run {fmt_time(as_run.step_time_s)}")
        if not as_run.feasible:
            bad.append(f"{placer}: OVER MEMORY AS RUN")
        times[placer] = as_run.step_time_s
        finer = out.coarsening.num_groups != prep.graph.num_nodes  # placed on a finer coarsening
        cells.append(f"{placer} {as_run.step_time_s * 1e3:.1f}" + (f" @{out.coarsening.num_groups}" if finer else ""))
    even = times.get("even")
    optimising = {p: t for p, t in times.items() if p != "even"}
    if optimising:
        best = min(optimising, key=lambda p: (optimising[p], p))
        best_cell = f"{best} {fmt_time(optimising[best])}"
        ratio = f"{optimising[best] / even:.2f}" if even else "-"
        best_time = f"{placement_s[best]:.1f}"
    else:
        best_cell, ratio, best_time = "NoFitError", "-", "-"
    check = "yes" if not bad else "; ".join(bad)
    return (f"| {full.name} | {cluster_name} | {prep.graph.num_nodes} | {single_cell} | "
            f"{fmt_time(even) if even else 'NoFitError'} | {best_cell} | {ratio} | {check} | {best_time} | "
            f"{', '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(c.name for c in CASES))
    parser.add_argument("--clusters", default=f"{SMALL},{BIG}")
    parser.add_argument("--placers", default=PLACERS)
    parser.add_argument("--max-nodes", type=int, default=250)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/devplace-beyond-zoo"))
    args = parser.parse_args()
    by_name = {c.name: c for c in CASES}
    unknown = [m for m in args.models.split(",") if m not in by_name]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    placers = args.placers.split(",")
    print(f"coarsened to {args.max_nodes} groups; placers {', '.join(placers)}; times are as-run step times\n")
    print("| model | cluster | groups | best single device | even | best placer | best / even | placed = as run, "
          "fits as run | placement time of best (s) | every placer (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---|")
    for name in args.models.split(","):
        for cluster_name in args.clusters.split(","):
            print(run_case(by_name[name], cluster_name, placers, args.max_nodes, args.cache), flush=True)


if __name__ == "__main__":
    main()
