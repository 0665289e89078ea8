"""The published-runs benchmark's data file: every row loads, names a source, a cluster that
loads (a preset, or a file beside the data) and a configuration the plan validates; a bad
row is refused naming the row and the field. (The pricing itself is the benchmark's,
``python benchmarks/published_runs.py``, minutes; not run here.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from autoplan.cluster import load_cluster
from autoplan.plan import ParallelConfig
from benchmarks.published_runs import DataError, cluster_of, load_runs

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_loads_with_its_cluster_and_a_valid_configuration():
    sources, runs = load_runs()
    assert len(runs) >= 30 and len({r["source"] for r in runs}) >= 6
    assert {r["source"] for r in runs} <= set(sources)
    for run in runs:
        cluster = load_cluster(cluster_of(run), nodes=run["gpus"] // 8)
        assert cluster.world_size == run["gpus"], run["id"]
        par = run["parallel"]
        fixed = {k: v for k, v in par.items() if v != "best"}
        dp = run["gpus"] // (par["tp"] * par["pp"] * par.get("cp", 1))
        ParallelConfig(dp=dp, **{k: v for k, v in fixed.items()
                                 if k not in ("micro_batch", "virtual_stages")})
    bloom = next(r for r in runs if r["id"] == "bloom-176b")
    jz = load_cluster(cluster_of(bloom))
    assert jz.inter_node.nics == 4 and jz.inter_node.bandwidth_gbps == 12


def test_a_bad_row_is_refused_naming_the_row_and_the_field(tmp_path):
    data = (ROOT / "benchmarks" / "data" / "published_runs.yaml").read_text()
    bad = tmp_path / "runs.yaml"
    bad.write_text(data.replace("parallel: {tp: 8, pp: 1, zero: 0, sequence_parallel: true",
                                "parallel: {tp: 8, pp: 1, zero: 0, sequence_parallel: true, "
                                "overlap: 1", 1))
    with pytest.raises(DataError, match=r"runs\[\d+\] \(kor-22b\): field 'parallel'"):
        load_runs(bad)


def test_unmodelled_rows_are_scored_but_never_fitted():
    from benchmarks.published_runs import loso

    rows = [{"source": "a", "ratio": 1.0}, {"source": "a", "ratio": 1.2},
            {"source": "b", "ratio": 1.1},
            {"source": "c", "ratio": 4.0, "modelled": False},
            {"source": "c", "ratio": 1.1}]
    loso(rows)
    # k over every modelled row: median(1.0, 1.2, 1.1, 1.1) = 1.1; the 4.0 never enters it
    assert rows[0]["k_in"] == pytest.approx(1.1)
    # source a is scored with k fitted on b and c's modelled rows only: median(1.1, 1.1)
    assert rows[0]["k_out"] == pytest.approx(1.1)
    # the unmodelled row is still scored, against the others' k
    assert rows[3]["err_out"] == pytest.approx(4.0 / rows[3]["k_out"] - 1)
    assert rows[3]["err_out"] > 2


def test_modelled_must_be_a_boolean(tmp_path):
    data = (ROOT / "benchmarks" / "data" / "published_runs.yaml").read_text()
    bad = tmp_path / "runs.yaml"
    bad.write_text(data.replace("    modelled: false", "    modelled: 'no'", 1))
    with pytest.raises(DataError, match=r"\(sc21-z3-175b-384\): field 'modelled'"):
        load_runs(bad)


def test_measured_memory_and_eager_fields_are_validated(tmp_path):
    """A row's measured peak memory is {value, unit} in GiB or GB and its error is the
    prediction over it; ``eager`` is a boolean; anything else names the row and field."""
    from benchmarks.published_runs import _published_memory

    _, runs = load_runs()
    measured = [r for r in runs if r.get("memory")]
    assert measured and all(r["source"] == "torchtitan" for r in measured)
    row = _published_memory({"memory": {"value": 80.0, "unit": "GiB"}}, 80 * 2 ** 30 * 0.9)
    assert row["published_memory_gb"] == pytest.approx(85.899, rel=1e-4)
    assert row["memory_err"] == pytest.approx(-0.1)
    assert _published_memory({}, 1.0) == {}
    data = (ROOT / "benchmarks" / "data" / "published_runs.yaml").read_text()
    for old, new, field in (("memory: {value: 82.4, unit: GiB}", "memory: {value: 82.4, unit: MB}",
                             "memory"),
                            ("memory: {value: 82.4, unit: GiB}", "memory: {value: -1, unit: GiB}",
                             "memory"),
                            ("    eager: true\n", "    eager: yes please\n", "eager")):
        bad = tmp_path / "runs.yaml"
        bad.write_text(data.replace(old, new, 1))
        with pytest.raises(DataError, match=rf"runs\[\d+\] \([\w.-]+\): field '{field}'"):
            load_runs(bad)
