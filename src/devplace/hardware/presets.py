"""Built-in cluster presets. Every number and its source is in docs/clusters.md; keep the two in step.

Conventions (docs/clusters.md, "Conventions"):

- `memory_bytes` is the capacity on the datasheet read as **decimal** gigabytes (a "16 GB" GPU has
  16e9 bytes). That is about 7% below the physical 16 GiB, roughly what is left after the CUDA context,
  ECC and allocator reserve, so it is a usable, slightly conservative capacity.
- `peak_flops` is the dense (no sparsity) peak at the precision of mixed-precision training: the FP16/BF16
  tensor-core peak on GPUs that have tensor cores, the FP32 peak on GPUs without fast FP16 (Kepler).
- `peak_flops_fp32/tf32/bf16/fp16` are the dense datasheet peaks per precision class (FP32 on the CUDA
  cores, TF32 / BF16 / FP16 on the tensor cores). A GPU without units for a precision gets the rate that
  precision runs at there: TF32 on V100 and K80 is plain FP32 (no TF32 units), BF16 on V100 and K80 and
  FP16 on K80 run on the CUDA cores at (at best) the FP32 rate.
- `speed = peak_flops / 125e12`, so the V100 SXM2 (125 TFLOPS dense FP16 tensor) is the reference 1.0 and
  a graph's `compute_s` is "seconds on a V100 SXM2". The one exception is `3xGPU-placeto`, whose speed is
  1.0 by definition (the seed study's graphs carry op times as profiled).
- Bandwidths are **effective** bytes/s per direction (what large copies reach), not the nominal line rate:
  NVLink 80% of 25 GB/s per link and direction; PCIe gen3 x16 12 GB/s of 15.75 GB/s; HDR InfiniBand
  22 GB/s of 25 GB/s. Latencies are per transfer, including software (copy launch, synchronisation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from devplace.hardware.cluster import Cluster, Device, Link

GB = 1e9  # decimal gigabyte: memory and bandwidth figures are in 10**9 bytes
TFLOPS = 1e12

# -- speed reference ---------------------------------------------------------------------------------
V100_PEAK_FLOPS = 125 * TFLOPS  # V100 SXM2, dense FP16 tensor core: the device of speed 1.0

# -- link types --------------------------------------------------------------------------------------
NVLINK_LINE_Bps = 25 * GB  # one NVLink (gen 2, 3 and 4) per direction, nominal
NVLINK_EFFICIENCY = 0.8  # effective / nominal (NVIDIA: ~20 of 25 GB/s per link with 128-byte payloads)
NVLINK_LATENCY_S = 5e-6  # estimate: ~1-2 us hardware, the rest copy launch and synchronisation
PCIE3_X16_LINE_Bps = 15.75 * GB  # 8 GT/s x 16 lanes, 128b/130b encoding, per direction
PCIE3_X16 = Link(bandwidth_Bps=12 * GB, latency_s=10e-6)  # effective (estimate)
PCIE4_X16_LINE_Bps = 31.5 * GB  # 16 GT/s x 16 lanes, 128b/130b encoding, per direction
PCIE4_X16 = Link(bandwidth_Bps=24 * GB, latency_s=10e-6)  # effective (estimate: gen3's 76% of the line rate)
PCIE3_ACROSS_SOCKETS = Link(bandwidth_Bps=10 * GB, latency_s=15e-6)  # PCIe + inter-socket link (estimate)
IB_HDR_LINE_Bps = 25 * GB  # 200 Gb/s HDR InfiniBand, per direction
IB_HDR = Link(bandwidth_Bps=22 * GB, latency_s=10e-6)  # effective GPU-to-GPU over GPUDirect RDMA (estimate)
PLACETO_BUS = Link(bandwidth_Bps=7600 * 1e6, latency_s=0.0)  # Placeto simulator: 7600 bytes/us, no latency


def nvlink(n_links: int) -> Link:
    """The effective link between two GPUs joined by `n_links` NVLinks (or an NVSwitch port group of that
    many links): n x 25 GB/s x 0.8 per direction, 5 us per transfer."""
    return Link(bandwidth_Bps=n_links * NVLINK_LINE_Bps * NVLINK_EFFICIENCY, latency_s=NVLINK_LATENCY_S)


# -- devices -----------------------------------------------------------------------------------------
class GpuSpec(NamedTuple):
    kind: str
    memory_bytes: float
    peak_flops: float  # dense, at the mixed-precision training precision (see the module docstring)
    mem_bandwidth_Bps: float
    peak_flops_fp32: float  # dense peaks per precision class (see the module docstring)
    peak_flops_tf32: float
    peak_flops_bf16: float
    peak_flops_fp16: float


# half a Tesla K80 board; Kepler has no tensor cores and no fast FP16: every precision at the FP32 rate
K80_GK210 = GpuSpec("K80 (one GK210)", 12 * GB, 4.37 * TFLOPS, 240 * GB, *[4.37 * TFLOPS] * 4)
# Volta: FP16 tensor cores; no TF32 and no BF16 units (both arrived with Ampere), those run at the FP32 rate
V100_PCIE_16GB = GpuSpec("V100-PCIe-16GB", 16 * GB, 112 * TFLOPS, 900 * GB,
                         14 * TFLOPS, 14 * TFLOPS, 14 * TFLOPS, 112 * TFLOPS)
V100_SXM2_32GB = GpuSpec("V100-SXM2-32GB", 32 * GB, 125 * TFLOPS, 900 * GB,
                         15.7 * TFLOPS, 15.7 * TFLOPS, 15.7 * TFLOPS, 125 * TFLOPS)
A100_SXM4_40GB = GpuSpec("A100-SXM4-40GB", 40 * GB, 312 * TFLOPS, 1555 * GB,
                         19.5 * TFLOPS, 156 * TFLOPS, 312 * TFLOPS, 312 * TFLOPS)
# the datasheet's tensor-core figures are with 2:4 sparsity; dense is half (docs/clusters.md)
H100_SXM5_80GB = GpuSpec("H100-SXM5-80GB", 80 * GB, 989.4 * TFLOPS, 3350 * GB,
                         67 * TFLOPS, 494.7 * TFLOPS, 989.4 * TFLOPS, 989.4 * TFLOPS)
# Ada L4 (72 W, PCIe): the datasheet's tensor-core figures are with 2:4 sparsity; dense is half (docs/clusters.md)
L4_24GB = GpuSpec("L4-24GB", 24 * GB, 121 * TFLOPS, 300 * GB, 30.3 * TFLOPS, 60 * TFLOPS, 121 * TFLOPS, 121 * TFLOPS)


def gpus(spec: GpuSpec, n: int, prefix: str = "gpu", speed: float | None = None) -> tuple[Device, ...]:
    """`n` identical devices named prefix0..prefix{n-1}; speed defaults to peak_flops / V100_PEAK_FLOPS."""
    s = spec.peak_flops / V100_PEAK_FLOPS if speed is None else speed
    return tuple(Device(name=f"{prefix}{i}", memory_bytes=spec.memory_bytes, speed=s,
                        peak_flops=spec.peak_flops, mem_bandwidth_Bps=spec.mem_bandwidth_Bps, kind=spec.kind,
                        peak_flops_fp32=spec.peak_flops_fp32, peak_flops_tf32=spec.peak_flops_tf32,
                        peak_flops_bf16=spec.peak_flops_bf16, peak_flops_fp16=spec.peak_flops_fp16)
                 for i in range(n))


def _meta(description: str) -> dict[str, str]:
    return {"description": description + " Numbers and sources: docs/clusters.md."}


# -- presets -----------------------------------------------------------------------------------------
def k80x2() -> Cluster:
    """Two K80 GPUs (the two GK210 dies of one Tesla K80 board, 12 GB each) on PCIe gen3 x16: the
    K80-era setting of the learned-placement literature."""
    return Cluster("2xK80", gpus(K80_GK210, 2), PCIE3_X16,
                   meta=_meta("2 GK210 GPUs (one Tesla K80 board), PCIe gen3 x16."))


def gpu3_placeto() -> Cluster:
    """The seed study's setting: 3 identical devices on the Placeto simulator's bus (7.6 GB/s, no
    latency). Placeto's simulator defaults were tuned for an AWS p2.8xlarge (K80), so the devices are
    K80 dies; speed is 1.0 by definition because the graphs carry op times as profiled."""
    return Cluster("3xGPU-placeto", gpus(K80_GK210, 3, speed=1.0), PLACETO_BUS,
                   meta=_meta("The seed study's setting: 3 identical GPUs, Placeto simulator bus 7.6 GB/s, "
                              "latency 0; speed 1.0 = op times as profiled."))


def v100x4_pcie() -> Cluster:
    """Four V100 PCIe 16 GB on PCIe gen3 x16 (no NVLink), every pair 12 GB/s effective."""
    return Cluster("4xV100-16GB", gpus(V100_PCIE_16GB, 4), PCIE3_X16,
                   meta=_meta("4 V100 PCIe 16 GB, PCIe gen3 x16, no NVLink."))


def l4x2_pcie() -> Cluster:
    """Two L4 24 GB on PCIe gen4 x16 (no NVLink: the L4 has none), 24 GB/s effective: the 2-GPU L4 setting of
    Mist (EuroSys'25)'s artifact."""
    return Cluster("2xL4-24GB", gpus(L4_24GB, 2), PCIE4_X16,
                   meta=_meta("2 L4 24 GB (NVIDIA L4 datasheet: FP32 30.3, TF32 120 and FP16/BF16 242 TFLOPS with "
                              "sparsity, 300 GB/s GDDR6), PCIe gen4 x16, no NVLink."))


# DGX-1 with V100 ("hybrid cube-mesh"): number of NVLinks between each joined pair (GPU numbers as
# nvidia-smi shows them). Each GPU has 6 NVLinks; GPUs 0-3 and 4-7 each form a fully connected quad
# (on CPU socket 0 and 1), and GPU i is joined to GPU i+4. The 12 remaining pairs have no NVLink.
DGX1V_NVLINKS: dict[tuple[int, int], int] = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2,
    (1, 2): 2, (1, 3): 1, (1, 5): 2,
    (2, 3): 2, (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1, (4, 6): 1, (4, 7): 2,
    (5, 6): 2, (5, 7): 1,
    (6, 7): 2,
}


def v100x8_dgx1() -> Cluster:
    """DGX-1 with 8 V100 SXM2 32 GB: NVLink2 hybrid cube-mesh, 2-link pairs 40 GB/s, 1-link pairs
    20 GB/s, pairs without NVLink go over PCIe and the inter-socket link (10 GB/s)."""
    links: dict[tuple[int, int], Link] = {}
    for (a, b), n in DGX1V_NVLINKS.items():
        links[(a, b)] = links[(b, a)] = nvlink(n)
    return Cluster("8xV100-32GB-NVLink", gpus(V100_SXM2_32GB, 8), PCIE3_ACROSS_SOCKETS, links,
                   meta=_meta("DGX-1 with 8 V100 SXM2 32 GB, NVLink2 hybrid cube-mesh; pairs without NVLink "
                              "use PCIe across the CPU sockets."))


def a100x8_dgx() -> Cluster:
    """DGX A100 (8 A100 SXM4 40 GB): 12 NVLink3 links per GPU into 6 NVSwitches, 300 GB/s per direction
    nominal, 240 GB/s effective between any pair."""
    return Cluster("8xA100-40GB-NVLink", gpus(A100_SXM4_40GB, 8), nvlink(12),
                   meta=_meta("DGX A100, 8 A100 SXM4 40 GB on NVSwitch (300 GB/s per direction nominal, "
                              "240 GB/s effective)."))


def h100x4_hgx() -> Cluster:
    """Four H100 SXM5 80 GB on an HGX H100 4-GPU board: NVLink4 without NVSwitch, each GPU's 18 links
    (450 GB/s per direction) split 6 per peer, so 150 GB/s nominal, 120 GB/s effective per pair."""
    return Cluster("4xH100-80GB-NVLink", gpus(H100_SXM5_80GB, 4), nvlink(6),
                   meta=_meta("HGX H100 4-GPU, 4 H100 SXM5 80 GB fully connected by NVLink4, 6 links per pair "
                              "(150 GB/s per direction nominal, 120 GB/s effective)."))


def h100x8_dgx() -> Cluster:
    """DGX H100 (8 H100 SXM5 80 GB): 18 NVLink4 links per GPU into NVSwitches, 450 GB/s per direction
    nominal, 360 GB/s effective between any pair."""
    return Cluster("8xH100-80GB-NVLink", gpus(H100_SXM5_80GB, 8), nvlink(18),
                   meta=_meta("DGX H100, 8 H100 SXM5 80 GB on NVSwitch (450 GB/s per direction nominal, "
                              "360 GB/s effective)."))


def a100x16_two_dgx() -> Cluster:
    """Two DGX A100 nodes: NVSwitch inside a node (the default link), one 200 Gb/s HDR InfiniBand NIC per
    GPU between nodes (explicit links for all 128 cross-node directed pairs)."""
    per_node = 8
    devices = gpus(A100_SXM4_40GB, per_node, prefix="node0.gpu") + gpus(A100_SXM4_40GB, per_node,
                                                                          prefix="node1.gpu")
    links: dict[tuple[int, int], Link] = {}
    for a in range(per_node):
        for b in range(per_node, 2 * per_node):
            links[(a, b)] = links[(b, a)] = IB_HDR
    return Cluster("2x8xA100-IB", devices, nvlink(12), links,
                   meta=_meta("Two DGX A100 nodes: NVSwitch within a node, 200 Gb/s HDR InfiniBand per GPU "
                              "between nodes (22 GB/s effective)."))


PRESETS: dict[str, Callable[[], Cluster]] = {
    "2xK80": k80x2,
    "2xL4-24GB": l4x2_pcie,
    "3xGPU-placeto": gpu3_placeto,
    "4xV100-16GB": v100x4_pcie,
    "8xV100-32GB-NVLink": v100x8_dgx1,
    "8xA100-40GB-NVLink": a100x8_dgx,
    "4xH100-80GB-NVLink": h100x4_hgx,
    "8xH100-80GB-NVLink": h100x8_dgx,
    "2x8xA100-IB": a100x16_two_dgx,
}


# Device kinds by short name, for costing a graph without a whole cluster (`devplace capture --device-kind`).
DEVICE_KINDS: dict[str, GpuSpec] = {"K80": K80_GK210, "V100": V100_SXM2_32GB, "V100-PCIe": V100_PCIE_16GB,
                                    "A100": A100_SXM4_40GB, "H100": H100_SXM5_80GB, "L4": L4_24GB}


def device_kind(name: str) -> Device:
    """One device of kind `name` (see DEVICE_KINDS), with the presets' speed convention."""
    from devplace.errors import ClusterError

    if name not in DEVICE_KINDS:
        raise ClusterError(f"unknown device kind {name!r}; choose one of: {', '.join(DEVICE_KINDS)}")
    return gpus(DEVICE_KINDS[name], 1)[0]
