"""Cluster presets, the `devplace.cluster/1` format and its error messages (docs/clusters.md)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devplace.errors import ClusterError, DevplaceError, FormatError
from devplace.hardware import Cluster, Device, Link, load_cluster, save_cluster
from devplace.hardware.presets import (
    DGX1V_NVLINKS,
    PRESETS,
    V100_PEAK_FLOPS,
    IB_HDR_LINE_Bps,
    NVLINK_LINE_Bps,
    PCIE3_X16_LINE_Bps,
    PCIE4_X16_LINE_Bps,
)

GB = 1e9

# name -> number of devices, as docs/clusters.md states them
DEVICE_COUNTS = {
    "2xK80": 2,
    "2xL4-24GB": 2,
    "3xGPU-placeto": 3,
    "4xV100-16GB": 4,
    "8xV100-32GB-NVLink": 8,
    "8xA100-40GB-NVLink": 8,
    "4xH100-80GB-NVLink": 4,
    "8xH100-80GB-NVLink": 8,
    "2x8xA100-IB": 16,
}
ALL = sorted(PRESETS)


def test_the_documented_presets_exist() -> None:
    assert set(PRESETS) == set(DEVICE_COUNTS)


def test_every_preset_is_in_the_docs() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "clusters.md").read_text(encoding="utf-8")
    for name in PRESETS:
        assert f"`{name}`" in doc, f"docs/clusters.md does not describe preset {name}"


# -- every preset ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_preset_loads_with_its_device_count(name: str) -> None:
    c = load_cluster(name)
    assert isinstance(c, Cluster)
    assert c.name == name
    assert c.num_devices == DEVICE_COUNTS[name]
    assert len({d.name for d in c.devices}) == c.num_devices, "device names must be unique"


@pytest.mark.parametrize("name", ALL)
def test_preset_numbers_are_finite_and_positive(name: str) -> None:
    c = load_cluster(name)
    for d in c.devices:
        for field in ("memory_bytes", "speed", "peak_flops", "mem_bandwidth_Bps"):
            x = getattr(d, field)
            assert math.isfinite(x) and x > 0, f"{name} {d.name}.{field} = {x!r}"
        assert d.kind
        assert 1 * GB <= d.memory_bytes <= 200 * GB
    off = ~np.eye(c.num_devices, dtype=bool)
    assert np.all(np.isfinite(c.bandwidth[off])) and np.all(c.bandwidth[off] > 0)
    assert np.all(np.isfinite(c.latency[off])) and np.all(c.latency[off] >= 0)
    assert np.all(c.latency[off] < 1e-3)
    assert np.all(np.isinf(np.diag(c.bandwidth))) and np.all(np.diag(c.latency) == 0)


@pytest.mark.parametrize("name", ALL)
def test_preset_links_are_symmetric(name: str) -> None:
    # every preset documents a symmetric topology: a -> b and b -> a are the same link
    c = load_cluster(name)
    np.testing.assert_array_equal(c.bandwidth, c.bandwidth.T)
    np.testing.assert_array_equal(c.latency, c.latency.T)


@pytest.mark.parametrize("name", ALL)
def test_preset_speed_convention(name: str) -> None:
    c = load_cluster(name)
    for d in c.devices:
        if name == "3xGPU-placeto":
            assert d.speed == 1.0  # op times as profiled, by definition
        else:
            assert d.speed == pytest.approx(d.peak_flops / V100_PEAK_FLOPS, rel=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_preset_effective_bandwidth_is_below_nominal(name: str) -> None:
    c = load_cluster(name)
    off = ~np.eye(c.num_devices, dtype=bool)
    assert c.bandwidth[off].max() <= 18 * NVLINK_LINE_Bps  # no pair above 18 NVLinks' line rate


@pytest.mark.parametrize("name", ALL)
def test_preset_round_trips_through_a_file(name: str, tmp_path: Path) -> None:
    c = load_cluster(name)
    path = tmp_path / f"{name}.json"
    save_cluster(c, path)
    back = load_cluster(path)
    assert back.to_dict() == c.to_dict()
    np.testing.assert_array_equal(back.bandwidth, c.bandwidth)
    np.testing.assert_array_equal(back.latency, c.latency)
    assert back.devices == c.devices
    # the file is stable: saving the loaded cluster gives the same bytes
    again = tmp_path / "again.json"
    save_cluster(back, again)
    assert again.read_bytes() == path.read_bytes()
    assert json.loads(path.read_text())["format"] == "devplace.cluster/1"


def test_preset_functions_return_fresh_clusters() -> None:
    a, b = load_cluster("2x8xA100-IB"), load_cluster("2x8xA100-IB")
    assert a is not b and a.links is not b.links


# -- specific presets --------------------------------------------------------------------------------
def test_v100_is_the_speed_reference() -> None:
    dgx1 = load_cluster("8xV100-32GB-NVLink")
    assert all(d.speed == 1.0 for d in dgx1.devices)
    speeds = {name: load_cluster(name).devices[0].speed for name in ALL}
    assert speeds["2xK80"] < speeds["4xV100-16GB"] < 1.0 < speeds["8xA100-40GB-NVLink"]
    assert speeds["8xA100-40GB-NVLink"] < speeds["4xH100-80GB-NVLink"] == speeds["8xH100-80GB-NVLink"]


def test_memory_convention_is_decimal_gigabytes() -> None:
    expect = {"2xK80": 12, "2xL4-24GB": 24, "3xGPU-placeto": 12, "4xV100-16GB": 16, "8xV100-32GB-NVLink": 32,
              "8xA100-40GB-NVLink": 40, "4xH100-80GB-NVLink": 80, "8xH100-80GB-NVLink": 80, "2x8xA100-IB": 40}
    for name, gb in expect.items():
        assert np.all(load_cluster(name).memory == gb * GB), name


def test_placeto_setting() -> None:
    c = load_cluster("3xGPU-placeto")
    assert c.num_devices == 3 and not c.links
    assert c.link == Link(bandwidth_Bps=7.6e9, latency_s=0.0)
    assert len({(d.memory_bytes, d.speed, d.kind) for d in c.devices}) == 1  # identical devices


def test_pcie_presets() -> None:
    for name in ("2xK80", "4xV100-16GB"):
        c = load_cluster(name)
        assert not c.links
        assert c.link.bandwidth_Bps == 12 * GB < PCIE3_X16_LINE_Bps
        assert c.link.latency_s == 10e-6
    l4 = load_cluster("2xL4-24GB")  # gen4: twice gen3's line rate, the same effective share
    assert not l4.links and l4.link.bandwidth_Bps == 24 * GB < PCIE4_X16_LINE_Bps == 2 * PCIE3_X16_LINE_Bps
    assert l4.devices[0].peak_flops_fp16 == 121e12 and l4.devices[0].peak_flops_fp32 == 30.3e12


def test_dgx1_topology() -> None:
    c = load_cluster("8xV100-32GB-NVLink")
    # the documented hybrid cube-mesh: 6 NVLinks per GPU, 16 joined pairs, 8 of them by two links
    per_gpu = [0] * 8
    for (a, b), n in DGX1V_NVLINKS.items():
        assert a < b and n in (1, 2)
        per_gpu[a] += n
        per_gpu[b] += n
    assert per_gpu == [6] * 8
    assert len(DGX1V_NVLINKS) == 16 and sum(n == 2 for n in DGX1V_NVLINKS.values()) == 8
    # each quad (0-3, 4-7) fully connected, plus i <-> i+4
    for quad in ((0, 1, 2, 3), (4, 5, 6, 7)):
        assert all((a, b) in DGX1V_NVLINKS for a in quad for b in quad if a < b)
    assert all((i, i + 4) in DGX1V_NVLINKS for i in range(4))

    two, one, none = 40 * GB, 20 * GB, 10 * GB
    assert c.bandwidth[0, 1] == one and c.bandwidth[1, 0] == one  # gpu0 <-> gpu1: one NVLink
    assert c.bandwidth[0, 3] == two and c.bandwidth[0, 4] == two  # two NVLinks
    assert c.bandwidth[1, 2] == two and c.bandwidth[1, 5] == two
    assert c.bandwidth[2, 6] == one and c.bandwidth[3, 7] == one
    for a, b in ((0, 5), (0, 6), (0, 7), (1, 4), (2, 5), (3, 6)):  # no direct NVLink: PCIe/QPI path
        assert (min(a, b), max(a, b)) not in DGX1V_NVLINKS
        assert c.bandwidth[a, b] == none and c.latency[a, b] == 15e-6
        assert c.pair(a, b) == c.link
    assert c.latency[0, 1] == 5e-6
    assert len(c.links) == 32
    off = ~np.eye(8, dtype=bool)
    assert sorted(set(c.bandwidth[off].tolist())) == [none, one, two]


def test_nvswitch_presets_are_uniform() -> None:
    for name, per_dir in (("8xA100-40GB-NVLink", 240 * GB), ("8xH100-80GB-NVLink", 360 * GB),
                          ("4xH100-80GB-NVLink", 120 * GB)):
        c = load_cluster(name)
        off = ~np.eye(c.num_devices, dtype=bool)
        assert not c.links
        assert np.all(c.bandwidth[off] == per_dir), name
        assert np.all(c.latency[off] == 5e-6), name


def test_two_node_a100() -> None:
    c = load_cluster("2x8xA100-IB")
    assert len(c.links) == 2 * 8 * 8  # every cross-node directed pair, nothing else
    node = np.repeat([0, 1], 8)
    for a in range(16):
        for b in range(16):
            if a == b:
                continue
            if node[a] == node[b]:
                assert (a, b) not in c.links and c.bandwidth[a, b] == 240 * GB
            else:
                assert c.bandwidth[a, b] == 22 * GB < IB_HDR_LINE_Bps and c.latency[a, b] == 10e-6
    assert c.devices[0].name == "node0.gpu0" and c.devices[15].name == "node1.gpu7"


# -- bad input ---------------------------------------------------------------------------------------
def _doc() -> dict[str, Any]:
    return copy.deepcopy(load_cluster("4xV100-16GB").to_dict())


def _write(tmp_path: Path, doc: Any, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return path


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ClusterError) as exc:
        load_cluster("9xTPU")
    msg = str(exc.value)
    assert "9xTPU" in msg
    for name in PRESETS:
        assert name in msg


def test_missing_file_is_a_cluster_error(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="neither a cluster preset nor a file"):
        load_cluster(tmp_path / "nope.json")


def test_missing_memory_bytes(tmp_path: Path) -> None:
    doc = _doc()
    del doc["devices"][2]["memory_bytes"]
    with pytest.raises(ClusterError, match=r'device #2 needs "memory_bytes"'):
        load_cluster(_write(tmp_path, doc))


@pytest.mark.parametrize("speed", [0, 0.0, -1.0, -0.5])
def test_non_positive_speed(speed: float) -> None:
    doc = _doc()
    doc["devices"][1]["speed"] = speed
    with pytest.raises(ClusterError, match=r'device #1: "speed" must be > 0'):
        Cluster.from_dict(doc)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "fast", None, True])
def test_non_numeric_speed(value: Any) -> None:
    doc = _doc()
    doc["devices"][0]["speed"] = value
    with pytest.raises(ClusterError, match=r'"speed" must be a finite number'):
        Cluster.from_dict(doc)


def test_nan_bandwidth_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "nan.json"
    text = json.dumps(_doc(), indent=1).replace('"bandwidth_Bps": 12000000000', '"bandwidth_Bps": NaN')
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ClusterError, match=r'"link": "bandwidth_Bps" must be a finite number, got nan'):
        load_cluster(path)


def test_nan_bandwidth_in_a_link() -> None:
    doc = _doc()
    doc["links"] = [{"src": 0, "dst": 1, "bandwidth_Bps": float("nan")}]
    with pytest.raises(ClusterError, match=r'links\[0\]: "bandwidth_Bps" must be a finite number'):
        Cluster.from_dict(doc)


@pytest.mark.parametrize("field,value,match", [
    ("bandwidth_Bps", 0, r'"bandwidth_Bps" must be > 0'),
    ("bandwidth_Bps", -1e9, r'"bandwidth_Bps" must be > 0'),
    ("latency_s", -1e-6, r'"latency_s" must be >= 0'),
])
def test_bad_default_link_numbers(field: str, value: float, match: str) -> None:
    doc = _doc()
    doc["link"][field] = value
    with pytest.raises(ClusterError, match=match):
        Cluster.from_dict(doc)


def test_missing_default_link() -> None:
    doc = _doc()
    del doc["link"]
    with pytest.raises(ClusterError, match=r'needs a default "link"'):
        Cluster.from_dict(doc)


@pytest.mark.parametrize("src,dst", [(0, 4), (7, 1), (-1, 0), (0, 1.0), ("0", 1), (True, 1), (None, 1)])
def test_link_to_a_device_out_of_range(src: Any, dst: Any) -> None:
    doc = _doc()
    doc["links"] = [{"src": src, "dst": dst, "bandwidth_Bps": 5e10}]
    with pytest.raises(ClusterError, match=r"links\[0\]: src and dst must be device indices 0\.\.3"):
        Cluster.from_dict(doc)


def test_duplicate_link() -> None:
    doc = _doc()
    doc["links"] = [{"src": 0, "dst": 1, "bandwidth_Bps": 5e10},
                    {"src": 1, "dst": 0, "bandwidth_Bps": 5e10},
                    {"src": 0, "dst": 1, "bandwidth_Bps": 4e10}]
    with pytest.raises(ClusterError, match=r"links\[2\]: second entry for link 0 -> 1"):
        Cluster.from_dict(doc)


def test_self_link() -> None:
    doc = _doc()
    doc["links"] = [{"src": 2, "dst": 2, "bandwidth_Bps": 5e10}]
    with pytest.raises(ClusterError, match=r"links\[0\]: src and dst are both 2"):
        Cluster.from_dict(doc)


def test_links_built_in_python_are_checked_too() -> None:
    devs = tuple(Device(f"gpu{i}", 16 * GB) for i in range(3))
    for bad in ((0, 3), (-1, 0), (1, 1)):
        with pytest.raises(ClusterError, match=r"link"):
            Cluster("x", devs, Link(1e10), {bad: Link(5e10)})


def test_empty_device_list() -> None:
    doc = _doc()
    doc["devices"] = []
    with pytest.raises(ClusterError, match=r'"devices" must be a non-empty list'):
        Cluster.from_dict(doc)


def test_huge_integer_is_a_cluster_error(tmp_path: Path) -> None:
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(_doc()).replace("16000000000", "1" + "0" * 400, 1), encoding="utf-8")
    with pytest.raises(ClusterError, match=r'"memory_bytes" must be a finite number'):
        load_cluster(path)


def test_unknown_format_version(tmp_path: Path) -> None:
    doc = _doc()
    doc["format"] = "devplace.cluster/2"
    with pytest.raises(FormatError, match=r"unknown version 'devplace.cluster/2'.*devplace.cluster/1"):
        load_cluster(_write(tmp_path, doc))
    with pytest.raises(FormatError, match=r"unknown version"):
        Cluster.from_dict(doc)


def test_wrong_or_missing_format(tmp_path: Path) -> None:
    doc = _doc()
    doc["format"] = "devplace.graph/1"
    with pytest.raises(FormatError, match=r"expected 'devplace.cluster/1'"):
        load_cluster(_write(tmp_path, doc))
    del doc["format"]
    with pytest.raises(FormatError, match=r'missing "format"'):
        load_cluster(_write(tmp_path, doc))
    with pytest.raises(FormatError, match=r"expected a JSON object"):
        load_cluster(_write(tmp_path, [doc]))


def test_malformed_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"format": "devplace.cluster/1",\n "devices": [\n  {"memory_bytes": 16e9,}\n ]}\n',
                    encoding="utf-8")
    with pytest.raises(FormatError) as exc:
        load_cluster(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:3:")
    assert "malformed JSON" in msg


def test_every_error_is_a_devplace_error() -> None:
    assert issubclass(ClusterError, DevplaceError) and issubclass(FormatError, DevplaceError)


def test_extra_top_level_keys_are_kept(tmp_path: Path) -> None:
    doc = _doc()
    doc["owner"] = "lab-42"
    c = load_cluster(_write(tmp_path, doc))
    assert c.meta["owner"] == "lab-42"
    assert c.to_dict()["owner"] == "lab-42"


def test_minimal_user_file(tmp_path: Path) -> None:
    # the example in docs/clusters.md: defaults fill speed (1.0) and latency (0)
    doc = {"format": "devplace.cluster/1", "name": "my-2gpu",
           "devices": [{"name": "a", "memory_bytes": 24e9}, {"name": "b", "memory_bytes": 24e9, "speed": 2.0}],
           "link": {"bandwidth_Bps": 2.5e10},
           "links": [{"src": 0, "dst": 1, "bandwidth_Bps": 5e10, "latency_s": 5e-6}]}
    c = load_cluster(_write(tmp_path, doc))
    assert c.num_devices == 2
    np.testing.assert_array_equal(c.speeds, [1.0, 2.0])
    assert c.bandwidth[0, 1] == 5e10 and c.bandwidth[1, 0] == 2.5e10
    assert c.latency[1, 0] == 0.0
    assert c.pair(0, 1).transfer_s(5e10) == pytest.approx(1 + 5e-6)


def test_unknown_device_or_link_key_is_an_error_with_a_suggestion(tmp_path):
    import json

    from devplace.errors import ClusterError
    from devplace.hardware import load_cluster as load

    doc = {"format": "devplace.cluster/1", "name": "x", "devices": [{"memory_bytes": 1e9, "sped": 2.0}],
           "link": {"bandwidth_Bps": 1e9}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ClusterError, match="unknown key 'sped'; did you mean 'speed'"):
        load(path)
    doc["devices"] = [{"memory_bytes": 1e9}, {"memory_bytes": 1e9}]
    doc["link"] = {"bandwidth_Bps": 1e9, "latency": 1e-5}
    path.write_text(json.dumps(doc))
    with pytest.raises(ClusterError, match="did you mean 'latency_s'"):
        load(path)


def test_links_and_meta_are_read_only_and_the_cluster_pickles() -> None:
    import pickle

    c = load_cluster("8xV100-32GB-NVLink")
    pair = next(iter(c.links))
    with pytest.raises(TypeError):
        c.links[pair] = Link(1.0)  # type: ignore[index]
    with pytest.raises(TypeError):
        c.meta["description"] = "x"  # type: ignore[index]
    back = pickle.loads(pickle.dumps(c))
    assert dict(back.links) == dict(c.links) and dict(back.meta) == dict(c.meta)
    assert np.array_equal(back.bandwidth, c.bandwidth) and np.array_equal(back.latency, c.latency)
