"""Fuzzed input files (issue #7): cluster and device YAML, op and link profiles.

Each surface gets 1,000 generated inputs (see tests/fuzz_helpers.py): valid documents (every
cluster preset and device file, slices of the committed profiles) mutated the way real
mistakes look, plus damaged, deeply nested and random text. Every input must be accepted (and
then round-trip) or rejected with the project's own error naming the file -- and the field,
when the text parses into a mapping; a bare exception, a hang or an unnamed file fails.
Plan files are fuzzed in tests/test_fuzz_plan.py, the command line in tests/test_fuzz_cli.py.
``pytest -s`` prints the counts; benchmarks/fuzz_counts.py writes them to a file.
"""

from __future__ import annotations

import json

import pytest

from autoplan.cluster import Cluster, load_cluster
from autoplan.errors import ConfigError, UnknownNameError
from autoplan.profile.files import ProfileError
from autoplan.profile.store import LinkProfile, OpProfile
from engine_helpers import deadline
from fuzz_helpers import (PROFILES, Tally, profile_seeds, run_cluster_fuzz, run_profile_fuzz,
                          scratch_dir)

EXAMPLES = 1000


def _assert_explored(tally: Tally) -> None:
    print("\n" + tally.line())
    assert tally.tried >= EXAMPLES
    assert not tally.unexpected, tally.examples
    # both outcomes were exercised, not only one
    assert tally.accepted >= EXAMPLES // 50
    assert sum(tally.rejected.values()) >= EXAMPLES // 2


def test_fuzz_cluster_and_device_yaml(tmp_path):
    with scratch_dir(tmp_path) as work:
        tally = run_cluster_fuzz(Tally("cluster and device YAML"), work,
                                 max_examples=EXAMPLES)
    _assert_explored(tally)
    assert set(tally.rejected) == {"ConfigError"}


def test_fuzz_op_and_link_profiles(tmp_path):
    with scratch_dir(tmp_path) as work:
        tally = run_profile_fuzz(Tally("op and link profiles"), work, max_examples=EXAMPLES)
    _assert_explored(tally)
    assert set(tally.rejected) == {"ProfileError"}


# ---- the bugs the fuzzer found, pinned ----------------------------------------------------

@pytest.mark.parametrize("body, needle", [
    (b"\xff\xfename: x\n", "not UTF-8 text: byte 0xff at line 1"),
    (b"name: x\nnodes: [" + b"[" * 5000 + b"]" * 5001 + b"\n", "line 2: nested more than 64"),
    (b"name: x\nnodes:\n" + b"- " * 100_000 + b"x\n", "nested too deeply"),
    (b"name: x\nnodes: " + b"9" * 5000 + b"\n", "a value cannot be read"),
    (b"? [a, b]\n: 1\n", "a key must be a plain value"),
    (b"name: x\nsince: 2020-13-45\n", "a value cannot be read"),
    # nine anchors of ten aliases each: 10^9 values from 400 bytes (was: memory grew
    # without bound, 3 GB in a minute)
    (b"name: x\ndescription: [" + b", ".join(
        b"&a%d [%s]" % (i, b", ".join([b"*a%d" % (i - 1) if i else b"x"] * 10))
        for i in range(9)) + b"]\n", "more than 100,000 values once its aliases"),
    (b"name: x\ndescription: &a [x, *a]\n", "line 2: an alias (*name) inside its own"),
], ids=["not-utf8", "deep-brackets", "deep-block-sequence", "huge-int", "list-key",
        "bad-date", "alias-bomb", "alias-cycle"])
def test_unreadable_cluster_yaml_is_a_config_error(tmp_path, body, needle):
    path = tmp_path / "c.yaml"
    path.write_bytes(body)
    with deadline(60), pytest.raises(ConfigError) as info:
        load_cluster(str(path))
    assert str(path) in str(info.value) and needle in str(info.value)


def test_a_cluster_file_may_still_use_anchors_and_aliases(tmp_path):
    """The alias bound above refuses expansions, not aliases: a value written once and
    reused loads as if written out twice."""
    text = _preset().replace("latency_us: 1.0", "latency_us: &lat 1.0", 1)
    assert "latency_us: 5.0" in text
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("latency_us: 5.0", "latency_us: *lat", 1))
    cluster = load_cluster(str(path))
    assert cluster.inter_node.latency_us == cluster.intra_node.latency_us == 1.0


def _preset(name: str = "dgx-a100") -> str:
    return (PROFILES / "clusters" / f"{name}.yaml").read_text()


@pytest.mark.parametrize("old, new, field, needle", [
    ("latency_us: 1.0", "latency_us: " + "9" * 400, "intra_node.latency_us", "400 digits"),
    ("bandwidth_gbps: 230", "bandwidth_gbps: 1.0e+300", "intra_node.bandwidth_gbps",
     "between 1e-09 and 1e+12"),
    ("bandwidth_gbps: 230", "bandwidth_gbps: 1.0e-320", "intra_node.bandwidth_gbps",
     "between"),
    ("nodes: 1", "nodes: 100000000", "nodes", "at most 16777216"),
    ("devices_per_node: 8", "devices_per_node: 8\n1: one", "1", "keys must be strings"),
    ("description:", '"": 3\ndescription:', '""', "unknown key"),
], ids=["400-digit-int", "1e300", "subnormal", "1e8-nodes", "int-key", "empty-key"])
def test_impossible_cluster_values_name_the_field(tmp_path, old, new, field, needle):
    path = tmp_path / "c.yaml"
    text = _preset()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load_cluster(str(path))
    assert str(path) in str(info.value) and info.value.field == field
    assert needle in str(info.value)


def test_world_size_is_bounded_when_widening_a_preset():
    with pytest.raises(ConfigError, match="more than 16777216 devices"):
        load_cluster("dgx-a100", nodes=2 ** 22)


def test_overrides_replace_a_device_field_that_is_not_a_mapping(tmp_path):
    doc = load_cluster("local-cpu").to_dict()
    doc["device"]["peak_tflops"] = 7.0           # local-cpu overrides peak_tflops key by key
    doc["device"]["sources"] = 3
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(doc))             # JSON is YAML
    cluster = load_cluster(str(path))            # was: TypeError '{**7.0}'
    assert cluster.device.peak_tflops == dict(doc["device_overrides"]["peak_tflops"])
    assert cluster.device.sources == dict(doc["device_overrides"]["sources"])


def test_a_name_too_long_for_the_os_is_an_unknown_name():
    """Was: OSError (ENAMETOOLONG) from Path.is_file()."""
    with pytest.raises(UnknownNameError, match="unknown cluster preset"):
        load_cluster("x" * 5000)
    with pytest.raises(ConfigError, match="field 'device': unknown device"):
        Cluster.from_dict({**load_cluster("dgx-a100").to_dict(), "device": "d" * 5000})


@pytest.mark.parametrize("body, needle", [
    (b"\xff{}", "not UTF-8 text: byte 0xff at line 1"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"version": ' + b"9" * 5000 + b"}", "a value cannot be read"),
    (b'{"format": "autoplan.op_profile", "format": "autoplan.op_profile"}',
     "duplicate key 'format'"),
], ids=["not-utf8", "deep", "huge-int", "duplicate-key"])
def test_unreadable_profile_is_a_profile_error(tmp_path, body, needle):
    path = tmp_path / "p.json"
    path.write_bytes(body)
    for cls in (OpProfile, LinkProfile):
        with pytest.raises(ProfileError) as info:
            cls.load(path)
        assert str(path) in str(info.value) and needle in str(info.value)


def test_profile_number_fields_reject_integers_too_large_for_a_float(tmp_path):
    doc = dict(profile_seeds())["ops:cpu-amd-epyc"]
    key = next(iter(doc["entries"]))
    doc["entries"][key]["fwd_s"] = 10 ** 400
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"fwd_s': must be a non-negative finite number"):
        OpProfile.load(path)


@pytest.mark.parametrize("change, field", [
    ({"level": "rack"}, "published[0].level"),
    ({"group_size": "eight"}, "published[0].group_size"),
    ({"colour": "red"}, "published[0].colour"),
])
def test_published_link_figures_are_checked(tmp_path, change, field):
    doc = dict(profile_seeds())["links:dgx-a100"]
    doc["published"][0].update(change)
    path = tmp_path / "links.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError) as info:
        LinkProfile.load(path)
    assert info.value.field == field
