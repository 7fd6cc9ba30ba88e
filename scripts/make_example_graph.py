"""Write the bundled example: the training step of a 16-layer MLP too big for one 16 GB GPU.

Model: 16 fully connected layers of width 8192 with ReLU, batch 2048, fp32, Adam (weights, gradients and
two optimizer states = 16 bytes per parameter, held where the layer's update runs). Op times are analytic:
FLOPs / (15.7 TFLOP/s * 0.7), the V100's fp32 peak at an assumed 70% efficiency for large GEMMs, and
bytes / (900 GB/s * 0.8) for elementwise ops. Run from the repository root:
`python scripts/make_example_graph.py` (writes src/devplace/data/example_mlp*.json).
"""

from __future__ import annotations

import json
from pathlib import Path

LAYERS, WIDTH, BATCH, DEVICES = 16, 8192, 2048, 4
F32 = 4
GEMM_FLOPS = 15.7e12 * 0.7
MEM_BPS = 900e9 * 0.8


def main() -> None:
    act = BATCH * WIDTH * F32
    gemm_s = 2 * BATCH * WIDTH * WIDTH / GEMM_FLOPS
    elem_s = 2 * act / MEM_BPS
    weight = WIDTH * WIDTH * F32
    nodes: list[dict] = []
    edges: list[dict] = []

    def node(nid: str, kind: str, seconds: float, out: int, group: str, op: str, **extra: object) -> None:
        nodes.append({"id": nid, "op": op, "kind": kind, "compute_s": round(seconds, 9), "output_bytes": out,
                      "group": group, **extra})

    def edge(src: str, dst: str, nbytes: int) -> None:
        edges.append({"src": src, "dst": dst, "bytes": nbytes})

    node("input", "forward", 0.0, act, "input", "data")
    prev = "input"
    for i in range(LAYERS):
        g = f"layer{i:02d}"
        node(f"{g}.fc", "forward", gemm_s, act, g, "aten.mm", flops=2 * BATCH * WIDTH * WIDTH)
        node(f"{g}.relu", "forward", elem_s, act, g, "aten.relu")
        edge(prev, f"{g}.fc", act)
        edge(f"{g}.fc", f"{g}.relu", act)
        prev = f"{g}.relu"
    node("loss", "forward", elem_s, F32, "loss", "aten.mse_loss")
    node("loss.grad", "backward", elem_s, act, "loss", "aten.mse_loss_backward")
    edge(prev, "loss", act)
    edge("loss", "loss.grad", F32)
    edge(prev, "loss.grad", act)
    grad = "loss.grad"
    for i in reversed(range(LAYERS)):
        g = f"layer{i:02d}"
        layer_in = "input" if i == 0 else f"layer{i - 1:02d}.relu"
        node(f"{g}.relu.grad", "backward", elem_s, act, g, "aten.threshold_backward")
        edge(grad, f"{g}.relu.grad", act)
        edge(f"{g}.relu", f"{g}.relu.grad", act)
        node(f"{g}.fc.grad_weight", "backward", gemm_s, weight, g, "aten.mm", flops=2 * BATCH * WIDTH * WIDTH)
        edge(f"{g}.relu.grad", f"{g}.fc.grad_weight", act)
        edge(layer_in, f"{g}.fc.grad_weight", act)
        node(f"{g}.adam", "optimizer", 4 * weight / MEM_BPS, 0, g, "aten._fused_adam", param_bytes=4 * weight)
        edge(f"{g}.fc.grad_weight", f"{g}.adam", weight)
        if i > 0:
            node(f"{g}.fc.grad_input", "backward", gemm_s, act, g, "aten.mm", flops=2 * BATCH * WIDTH * WIDTH)
            edge(f"{g}.relu.grad", f"{g}.fc.grad_input", act)
            grad = f"{g}.fc.grad_input"
    name = f"mlp{LAYERS}-w{WIDTH}-b{BATCH}"
    data = Path("src/devplace/data")
    doc = {"format": "devplace.graph/1", "name": name,
           "description": "training step of a 16-layer MLP (width 8192, batch 2048, fp32, Adam); analytic "
                          "V100 op times; written by scripts/make_example_graph.py",
           "nodes": nodes, "edges": edges}
    (data / "example_mlp.json").write_text(json.dumps(doc, indent=1) + "\n")
    per_dev = LAYERS // DEVICES
    assignment = {}
    for n in nodes:
        grp = n["group"]
        layer = 0 if grp == "input" else LAYERS - 1 if grp == "loss" else int(grp[5:])
        assignment[n["id"]] = layer // per_dev
    placement = {"format": "devplace.placement/1", "graph": name, "cluster": "4xV100-16GB",
                 "description": "hand-written pipeline split: 4 consecutive layers per GPU",
                 "assignment": assignment}
    (data / "example_mlp.placement.json").write_text(json.dumps(placement, indent=1) + "\n")


if __name__ == "__main__":
    main()
