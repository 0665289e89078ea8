"""Cluster model: presets, device specs, YAML validation, round-trips."""

from __future__ import annotations

import json
import textwrap

import pytest

from autoplan.cluster import (Cluster, DeviceSpec, LinkSpec, list_cluster_presets, list_devices,
                              load_cluster, load_device)
from autoplan.errors import ConfigError, UnknownNameError

GOOD = textwrap.dedent("""\
    name: foo
    nodes: 2
    devices_per_node: 8
    device: a100-80gb
    intra_node: {kind: nvswitch, bandwidth_gbps: 230, latency_us: 1.0, source: test}
    inter_node: {kind: infiniband, nics: 8, bandwidth_gbps: 24, latency_us: 5, source: test}
    """)


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    """A private profiles dir (via $AUTOPLAN_PROFILES) with the real devices and 'foo'."""
    from autoplan.yaml_files import profiles_root

    real = profiles_root()
    (tmp_path / "devices").mkdir()
    (tmp_path / "clusters").mkdir()
    for f in (real / "devices").glob("*.yaml"):
        (tmp_path / "devices" / f.name).write_text(f.read_text())
    monkeypatch.setenv("AUTOPLAN_PROFILES", str(tmp_path))
    return tmp_path


def write_preset(profiles, text: str, name: str = "foo") -> str:
    (profiles / "clusters" / f"{name}.yaml").write_text(text)
    return name


def error_of(profiles, text: str) -> str:
    write_preset(profiles, text)
    with pytest.raises(ConfigError) as exc:
        load_cluster("foo")
    return str(exc.value)


# ---- presets and devices -----------------------------------------------------------------

def test_presets_and_devices_are_listed():
    assert {"dgx-a100", "dgx-a100-40gb", "dgx-h100", "dgx-h200", "dgx-v100",
            "local-cpu"} <= set(list_cluster_presets())
    assert {"v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h200-sxm",
            "cpu-local"} <= set(list_devices())


def test_dgx_a100_figures():
    c = load_cluster("dgx-a100")
    assert (c.nodes, c.devices_per_node, c.world_size) == (1, 8, 8)
    assert c.device.name == "a100-80gb"
    assert c.device.peak_flops("bfloat16") == 312e12
    assert c.device.peak_flops("torch.float16") == 312e12
    assert c.device.peak_flops("fp32") == 19.5e12
    assert c.device.memory_bytes == pytest.approx(81920 * 2 ** 20, rel=1e-4)   # nvidia-smi
    assert c.device.memory_bandwidth == c.device.memory_bandwidth_bytes == 2039e9
    assert c.intra_node.bandwidth == 230e9
    assert c.node_nic_bandwidth == pytest.approx(192e9)      # 8 x HDR, published busbw
    assert c.device_type == "cuda"


def test_h100_h200_v100_figures():
    h100, h200 = load_device("h100-sxm"), load_device("h200-sxm")
    assert h100.peak_flops("bfloat16") == h200.peak_flops("bfloat16") == 989e12
    assert h100.memory_bytes == pytest.approx(81559 * 2 ** 20, rel=1e-4)       # nvidia-smi
    assert h200.memory_gb == 141
    assert (h100.memory_bandwidth_gbps, h200.memory_bandwidth_gbps) == (3350, 4800)
    assert load_cluster("dgx-h100").intra_node.bandwidth_gbps == 370
    v100 = load_device("v100-32gb")
    assert v100.peak_flops("float16") == 125e12
    with pytest.raises(UnknownNameError, match="bfloat16"):
        v100.peak_flops("bfloat16")                           # Volta has no bf16 tensor cores


def test_every_device_cites_every_figure():
    for name in list_devices():
        dev = load_device(name)
        assert set(dev.sources) >= {"peak_tflops", "memory_gb", "memory_bandwidth_gbps"}, name
        assert all(len(s) > 10 for s in dev.sources.values()), name
    assert "ESTIMATE" in load_device("cpu-local").sources["peak_tflops"]


def test_local_cpu_is_a_quarter_of_the_machine():
    c = load_cluster("local-cpu")
    whole = load_device("cpu-local")
    assert (c.world_size, c.device_type, c.inter_node.kind) == (4, "cpu", "ethernet")
    assert c.device.peak_flops("float32") == pytest.approx(whole.peak_flops("float32") / 4,
                                                           rel=0.01)
    assert c.device.memory_gb == whole.memory_gb / 4
    assert c.device.sources["memory_gb"].startswith("ESTIMATE")
    assert c.intra_node.kind == "loopback"


def test_nodes_override_and_with_nodes():
    selene = load_cluster("dgx-a100", nodes=64)
    assert selene.world_size == 512
    assert selene.with_nodes(2).world_size == 16
    assert load_cluster("dgx-a100").with_nodes(64) == selene
    with pytest.raises(ConfigError, match="field 'nodes': must be a positive integer, got 0"):
        load_cluster("dgx-a100", nodes=0)
    with pytest.raises(ConfigError, match="field 'nodes': must be >= 1, got 0"):
        load_cluster("dgx-a100").with_nodes(0)


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "local-cpu"])
def test_to_dict_from_dict_round_trip(name):
    c = load_cluster(name, nodes=1)
    d = json.loads(json.dumps(c.to_dict()))          # what a plan stores and reloads
    again = Cluster.from_dict(d, source="plan.json")
    assert again == c
    assert again.to_dict() == c.to_dict()
    assert again.source == f"clusters/{name}.yaml"


def test_clusters_are_hashable_and_picklable():
    import pickle

    c = load_cluster("dgx-h100", nodes=4)
    assert pickle.loads(pickle.dumps(c)) == c
    assert len({c, load_cluster("dgx-h100", nodes=4), c.with_nodes(2)}) == 2


def test_inline_device_and_overrides(profiles):
    text = GOOD.replace("device: a100-80gb", textwrap.dedent("""\
        device: a100-80gb
        device_overrides: {memory_gb: 72, peak_tflops: {bfloat16: 300}}"""))
    c = load_cluster(write_preset(profiles, text))
    assert c.device.memory_gb == 72
    assert c.device.peak_tflops["bfloat16"] == 300
    assert c.device.peak_tflops["float32"] == 19.5                 # merged, not replaced
    assert c.device_overrides == {"memory_gb": 72, "peak_tflops": {"bfloat16": 300}}


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(GOOD)
    c = load_cluster(str(path))
    assert (c.name, c.world_size, c.source) == ("foo", 16, str(path))


# ---- errors name the file and the field --------------------------------------------------

def test_unknown_key(profiles):
    msg = error_of(profiles, GOOD + "nodez: 3\n")
    assert msg.startswith("clusters/foo.yaml: field 'nodez': unknown key; known: ")


def test_negative_bandwidth(profiles):
    msg = error_of(profiles, GOOD.replace("bandwidth_gbps: 24", "bandwidth_gbps: -5"))
    assert msg == "clusters/foo.yaml: field 'inter_node.bandwidth_gbps': must be > 0, got -5"


def test_zero_nodes(profiles):
    msg = error_of(profiles, GOOD.replace("nodes: 2", "nodes: 0"))
    assert msg == "clusters/foo.yaml: field 'nodes': must be >= 1, got 0"


def test_bad_values_are_reported_before_missing_sections(profiles):
    msg = error_of(profiles, "name: bad\nnodes: 0\ndevices_per_node: 8\ndevice: a100-80gb\n")
    assert msg == "clusters/foo.yaml: field 'nodes': must be >= 1, got 0"


def test_wrong_type(profiles):
    msg = error_of(profiles, GOOD.replace("nodes: 2", "nodes: two"))
    assert msg == "clusters/foo.yaml: field 'nodes': must be an integer, got 'two'"


def test_missing_device(profiles):
    msg = error_of(profiles, GOOD.replace("device: a100-80gb\n", ""))
    assert msg == "clusters/foo.yaml: field 'device': missing"
    msg = error_of(profiles, "\n".join(GOOD.splitlines()[:-1]) + "\n")
    assert msg == "clusters/foo.yaml: field 'inter_node': missing"


def test_unknown_device_name(profiles):
    msg = error_of(profiles, GOOD.replace("a100-80gb", "a100-99gb"))
    assert msg.startswith("clusters/foo.yaml: field 'device': unknown device 'a100-99gb'; "
                          "known: a100-40gb, a100-80gb")


def test_invalid_yaml_syntax(profiles):
    msg = error_of(profiles, GOOD.replace("devices_per_node: 8", "devices_per_node: [8"))
    assert msg.startswith("clusters/foo.yaml: invalid YAML at line ")


def test_duplicate_key(profiles):
    msg = error_of(profiles, GOOD + "nodes: 4\n")
    assert "clusters/foo.yaml: invalid YAML at line 7" in msg and "duplicate key 'nodes'" in msg


def test_nvswitch_with_odd_device_count(profiles):
    msg = error_of(profiles, GOOD.replace("devices_per_node: 8", "devices_per_node: 3"))
    assert msg.startswith("clusters/foo.yaml: field 'devices_per_node': nvswitch boards "
                          "carry an even number of devices")


def test_bad_link_kind_and_override_key(profiles):
    msg = error_of(profiles, GOOD.replace("kind: infiniband", "kind: carrier-pigeon"))
    assert msg.startswith("clusters/foo.yaml: field 'inter_node.kind': must be one of ")
    msg = error_of(profiles, GOOD.replace("latency_us: 1.0,", "latency_us: 1.0, nics: 2,"))
    assert msg.startswith("clusters/foo.yaml: field 'intra_node.nics': applies to inter_node")
    msg = error_of(profiles, GOOD.replace("kind: infiniband", "kind: nvlink"))
    assert msg.startswith("clusters/foo.yaml: field 'inter_node.kind': nvlink is an intra-node")
    msg = error_of(profiles, GOOD + "device_overrides: {memory_gbs: 3}\n")
    assert msg.startswith("clusters/foo.yaml: field 'device_overrides.memory_gbs': unknown key")
    msg = error_of(profiles, GOOD + "device_overrides: {memory_gb: -1}\n")
    assert msg == "clusters/foo.yaml: field 'device.memory_gb': must be > 0, got -1"


def test_device_file_errors(profiles):
    (profiles / "devices" / "bad.yaml").write_text(
        "family: gpu\npeak_tflops: {bfloat16: 100, float33: 1}\nmemory_gb: 10\n"
        "memory_bandwidth_gbps: 100\nsources: {peak_tflops: x, memory_gb: y, "
        "memory_bandwidth_gbps: z}\n")
    with pytest.raises(ConfigError) as exc:
        load_device("bad")
    assert str(exc.value).startswith("devices/bad.yaml: field 'peak_tflops.float33': "
                                     "unknown dtype")
    (profiles / "devices" / "nosrc.yaml").write_text(
        "peak_tflops: {bfloat16: 100}\nmemory_gb: 10\nmemory_bandwidth_gbps: 100\n")
    with pytest.raises(ConfigError, match=r"devices/nosrc.yaml: field 'sources.peak_tflops': "
                                          r"missing"):
        load_device("nosrc")


def test_unknown_names():
    with pytest.raises(UnknownNameError) as exc:
        load_cluster("dgx-z9000")
    assert "unknown cluster preset 'dgx-z9000'; known: dgx-a100, dgx-a100-40gb" in str(exc.value)
    with pytest.raises(UnknownNameError, match="unknown device 'tpu'; known: a100-40gb"):
        load_device("tpu")
    with pytest.raises(ConfigError, match="nope.yaml: no such file"):
        load_cluster("nope.yaml")


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="field 'latency_us': must be >= 0, got -1"):
        LinkSpec(kind="nvlink", bandwidth_gbps=1, latency_us=-1)
    with pytest.raises(ConfigError, match="field 'memory_gb': must be > 0"):
        DeviceSpec(name="x", peak_tflops={"float32": 1}, memory_gb=0, memory_bandwidth_gbps=1)
