"""Profiles: alpha-beta fit, link and op profile files, op replay, the op-time lookup,
resumable op profiling, concurrent writers, and (multiproc) the gloo link benchmark."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autoplan.errors import AutoplanError
from autoplan.graph import OpNode, TensorMeta
from autoplan.profile.fit import MB, AlphaBeta, bus_factor, fit_alpha_beta, max_relative_error
from autoplan.profile.store import (LinkPoint, fit_link_points, LinkProfile, OpEntry, OpProfile, ProfileError,
                                    add_op_entries)

REPO = Path(__file__).resolve().parents[1]
LOCAL_LINKS = REPO / "profiles" / "links" / "local-cpu.json"
T = TensorMeta


def _node(name: str, op: str, ins: list[TensorMeta], outs: list[TensorMeta], role="replicated",
          flops: float = 0.0) -> OpNode:
    return OpNode(name=name, op=op, inputs=[], input_meta=ins, output_meta=outs,
                  fwd_flops=flops, bwd_flops=2 * flops, bytes_read=0, bytes_written=0,
                  tp_role=role)


def _mm(m: int, k: int, n: int, role="replicated") -> OpNode:
    return _node(f"mm{m}x{k}x{n}", "aten.mm.default", [T((m, k), "float32"), T((k, n), "float32")],
                 [T((m, n), "float32")], role, 2.0 * m * k * n)


def _entry(node: OpNode, fwd: float, bwd: float, flops: float, source="s") -> OpEntry:
    return OpEntry(op=node.op, dtype="float32", inputs=tuple(node.input_meta),
                   outputs=tuple(node.output_meta), fwd_s=fwd, bwd_s=bwd, repeats=5,
                   flops=flops, bytes=sum(t.nbytes for t in (*node.input_meta, *node.output_meta)),
                   source=source)


# ---- fit ---------------------------------------------------------------------------------

def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert bus_factor("send_recv", 2) == 1.0
    with pytest.raises(AutoplanError, match="unknown collective"):
        bus_factor("broadcast", 2)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "send_recv"])
def test_fit_reproduces_synthetic_alpha_beta_exactly(collective):
    truth = AlphaBeta(alpha_s=35e-6, busbw_gbps=3.7)
    sizes = np.array([8 * 4 ** k for k in range(12)], dtype=float)
    nbytes = np.concatenate([sizes, sizes])
    groups = np.array([2] * len(sizes) + [4] * len(sizes))
    times = truth.predict(collective, nbytes, groups)
    fit = fit_alpha_beta(collective, nbytes, groups, times)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
    assert fit.busbw_gbps == pytest.approx(truth.busbw_gbps, rel=1e-9)


def test_fit_rejects_flat_timings():
    with pytest.raises(AutoplanError, match="does not grow"):
        fit_alpha_beta("all_reduce", np.array([8.0, 16.0, 32.0]), 2, np.array([3e-4, 2e-4, 1e-4]))


def test_fit_link_points_gives_per_size_and_pooled_fits():
    truth = AlphaBeta(alpha_s=1e-4, busbw_gbps=1.0)
    points = [LinkPoint("all_reduce", n, "intra", b, float(truth.predict("all_reduce", b, n)),
                        0.0, 0.0, "s") for n in (2, 4) for b in (1024, MB, 8 * MB)]
    fits, problems = fit_link_points(points, "fit")
    assert not problems
    assert sorted((f.group_size or 0) for f in fits) == [0, 2, 4]
    assert all(f.max_rel_err_ge_1mb == pytest.approx(0.0, abs=1e-9) for f in fits)


def test_segments_follow_a_two_regime_link():
    from autoplan.profile.fit import fit_segments, segmented_error

    # cache-resident messages at 4 GB/s, DRAM-bound ones at 1 GB/s (the CPU loopback shape)
    sizes = np.array([8 * 2 ** k for k in range(23)], dtype=float)
    fast, slow = AlphaBeta(1e-4, 4.0), AlphaBeta(5e-4, 1.0)
    times = np.where(sizes < 2 * MB, fast.predict("all_reduce", sizes, 2),
                     slow.predict("all_reduce", sizes, 2))
    line = fit_alpha_beta("all_reduce", sizes, 2, times)
    assert max_relative_error(line, "all_reduce", sizes, 2, times) > 0.2
    segs = fit_segments("all_reduce", sizes, 2, times)
    assert len(segs) == 2 and segs[1].min_bytes == 2 * MB
    assert segmented_error(segs, "all_reduce", sizes, 2, times) == pytest.approx(0, abs=1e-9)
    assert segs[1].fit.busbw_gbps == pytest.approx(1.0)


# ---- the committed profiles -------------------------------------------------------------

def test_committed_local_link_profile_reproduces_its_points_within_20_percent():
    prof = LinkProfile.load(LOCAL_LINKS)
    assert prof.backend == "gloo" and prof.levels_present == ["intra"]
    assert "intra" in prof.note
    sizes = {p.group_size for p in prof.points}
    assert {2, 4} <= sizes
    big = [p for p in prof.points if p.bytes >= MB]
    assert {p.collective for p in big} == {"all_reduce", "all_gather", "reduce_scatter",
                                           "all_to_all", "send_recv"}
    for p in big:
        pred = prof.predict(p.collective, p.level, p.bytes, p.group_size)
        assert abs(pred - p.time_s) / p.time_s <= 0.20, (p, pred)
    for f in prof.fits:
        assert prof.sources[f.source]["kind"] == "measured"
    assert all("load_avg" in prof.sources[p.source] for p in prof.points)
    per_size = prof.fitted_table(group_size=4, nbytes=16 * MB)
    alpha, beta = per_size[("all_reduce", "intra")]
    measured = next(p for p in prof.points if (p.collective, p.group_size, p.bytes) ==
                    ("all_reduce", 4, 16 * MB))
    assert alpha + 16 * MB * bus_factor("all_reduce", 4) * beta == pytest.approx(
        measured.time_s, rel=0.2)


def test_reference_profiles_are_published_and_feed_the_comm_model():
    from autoplan.cluster import load_cluster
    from autoplan.cost.comm import CommModel

    for name, intra in (("dgx-a100", 230.0), ("dgx-h100", 370.0)):
        prof = LinkProfile.load(REPO / "profiles" / "links" / f"{name}.json")
        assert prof.points == [] and prof.published
        assert all(prof.sources[f.source]["kind"] == "published" for f in prof.fits)
        assert prof.fit_for("all_reduce", "intra").busbw_gbps == intra
        table = prof.fitted_table()
        assert len(table) == 10
        model = CommModel(load_cluster(name), fitted=table)
        assert model.fitted[("all_reduce", "intra")] == table[("all_reduce", "intra")]
        # 1 GB all-reduce over 8 GPUs: alpha + 2·7/8·1e9 / busbw (published.md's formula)
        expect = table[("all_reduce", "intra")][0] + 1.75e9 / (intra * 1e9)
        assert prof.predict("all_reduce", "intra", 1e9, 8) == pytest.approx(expect)


# ---- malformed files ----------------------------------------------------------------------

def _op_profile_dict() -> dict:
    node = _mm(4, 8, 16)
    prof = OpProfile(device="cpu-test", entries={}, sources={"s": {"kind": "measured"}})
    e = _entry(node, 1e-5, 2e-5, 1024.0)
    prof.entries[e.key] = e
    return prof.to_dict()


def _mutate_entry(d: dict, **changes) -> dict:
    key = next(iter(d["entries"]))
    d["entries"][key].update(changes)
    return d


@pytest.mark.parametrize("mutate, field", [
    (lambda d: {**d, "version": 7}, "version"),
    (lambda d: {**d, "format": "autoplan.plan"}, "format"),
    (lambda d: {k: v for k, v in d.items() if k != "device"}, "device"),
    (lambda d: {**d, "colour": 1}, "colour"),
    (lambda d: _mutate_entry(d, fwd_s=-1.0), "fwd_s"),
    (lambda d: _mutate_entry(d, fwd_s="fast"), "fwd_s"),
    (lambda d: _mutate_entry(d, repeats=0), "repeats"),
    (lambda d: _mutate_entry(d, source="nowhere"), "source"),
    (lambda d: _mutate_entry(d, inputs=[{"dtype": "float32", "shape": [4, -8]}]), "inputs[0].shape"),
    (lambda d: _mutate_entry(d, op="aten.bmm.default"), "entries["),
])
def test_malformed_op_profile_names_file_and_field(tmp_path, mutate, field):
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(mutate(_op_profile_dict())))
    with pytest.raises(ProfileError) as exc:
        OpProfile.load(path)
    assert str(path) in str(exc.value) and field in str(exc.value)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["points"][0].update(collective="broadcast"), "points[0].collective"),
    (lambda d: d["points"][0].update(time_s=0), "points[0].time_s"),
    (lambda d: d["points"][0].update(group_size=1), "points[0].group_size"),
    (lambda d: d["fits"][0].update(busbw_gbps=None), "fits[0].busbw_gbps"),
    (lambda d: d["fits"][0].update(level="rack"), "fits[0].level"),
    (lambda d: d.update(levels_present=["intra", "moon"]), "levels_present[1]"),
    (lambda d: d["sources"]["s"].update(kind="guess"), "sources.s.kind"),
])
def test_malformed_link_profile_names_file_and_field(tmp_path, mutate, field):
    fits, _ = fit_link_points([LinkPoint("all_reduce", 2, "intra", b, 1e-4 + b / 1e9, 0, 0, "s")
                               for b in (1024, MB)], "s")
    d = LinkProfile(cluster="c", backend="gloo", levels_present=["intra"],
                    points=[LinkPoint("all_reduce", 2, "intra", 1024, 1e-4, 0.01, 0.01, "s")],
                    fits=fits, sources={"s": {"kind": "measured"}}).to_dict()
    mutate(d)
    path = tmp_path / "links.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as exc:
        LinkProfile.load(path)
    assert str(path) in str(exc.value) and field in str(exc.value)


def test_unreadable_profile_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ProfileError, match=r"bad\.json: not valid JSON \(line 1"):
        OpProfile.load(bad)
    with pytest.raises(ProfileError, match="missing.json: no such profile file"):
        LinkProfile.load(tmp_path / "missing.json")


# ---- concurrent writers -------------------------------------------------------------------

def _writer(path: str, tag: int, count: int) -> None:
    for i in range(count):
        node = _mm(tag * 1000 + i + 1, 8, 8)
        add_op_entries(path, "cpu-test", [_entry(node, 1e-5, 2e-5, 1.0, source=f"w{tag}")],
                       {f"w{tag}": {"kind": "measured", "writer": tag}})


def test_two_concurrent_writers_leave_a_valid_file_with_both(tmp_path):
    path = tmp_path / "ops.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), tag, 25)) for tag in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    prof = OpProfile.load(path)
    assert len(prof.entries) == 50
    assert {e.source for e in prof.entries.values()} == {"w1", "w2"}
    assert set(prof.sources) == {"w1", "w2"}
    assert not list(tmp_path.glob(".ops.json.*.tmp"))


# ---- replay and sharding ------------------------------------------------------------------

def test_replay_recovers_non_tensor_arguments():
    from autoplan.profile.replay import reconstruct
    from autoplan.profile.signature import Signature

    x = T((2, 64, 4, 16), "float32")
    tr = reconstruct(Signature("aten.transpose.int", (x,), (T((2, 4, 64, 16), "float32"),)))
    assert sorted(tr.arguments().values()) == [1, 2]
    ln = reconstruct(Signature("aten.native_layer_norm.default",
                               (T((2, 64, 64), "float32"), T((64,), "float32"),
                                T((64,), "float32")),
                               (T((2, 64, 64), "float32"), T((2, 64, 1), "float32"),
                                T((2, 64, 1), "float32"))))
    assert ln.arguments()["normalized_shape"] == [64]
    sm = reconstruct(Signature("aten.sum.dim_IntList", (T((8, 5), "float32"),),
                               (T((5,), "float32"),)))
    assert sm.arguments()["dim"] in ([0], [-2])


def test_tp_shards_follow_megatron_roles():
    from autoplan.profile.replay import sharded_call
    from autoplan.profile.signature import Signature

    lin = Signature("aten.addmm.default", (T((256,), "float32"), T((128, 64), "float32"),
                                           T((64, 256), "float32")), (T((128, 256), "float32"),))
    col, _ = sharded_call(lin, "column", 4)
    assert [t.shape for t in col.inputs] == [(64,), (128, 64), (64, 64)]
    assert col.outputs[0].shape == (128, 64)
    row, _ = sharded_call(lin, "row", 2)
    assert [t.shape for t in row.inputs] == [(256,), (128, 32), (32, 256)]
    q = T((2, 4, 64, 16), "float32")
    attn = Signature("aten._scaled_dot_product_efficient_attention.default", (q, q, q),
                     (q, T((2, 4, 64), "float32"), T((), "int64"), T((), "int64")))
    shard, _ = sharded_call(attn, "sharded", 2)
    assert shard.inputs[0].shape == (2, 2, 64, 16) and shard.outputs[1].shape == (2, 2, 64)


# ---- the op-time table --------------------------------------------------------------------

def _table_profile() -> OpProfile:
    entries = {}
    for m, fwd in ((64, 1e-4), (256, 4e-4)):        # time linear in work between them
        node = _mm(m, 64, 64)
        e = _entry(node, fwd, 2 * fwd, 2.0 * m * 64 * 64)
        entries[e.key] = e
    col = _mm(128, 32, 32)                           # the tp=2 column shard of mm 128x32x64
    e = _entry(col, 7e-5, 1.4e-4, 2.0 * 128 * 32 * 32)
    entries[e.key] = e
    return OpProfile(device="cpu-test", entries=entries, sources={"s": {"kind": "measured"}})


def test_op_table_exact_interpolated_and_miss():
    from autoplan.profile.lookup import OpTimeTable

    table = OpTimeTable(_table_profile())
    assert table.lookup(_mm(64, 64, 64)) == (1e-4, 2e-4)
    assert table.last_source == "exact"
    fwd, bwd = table.lookup(_mm(128, 64, 64))        # halfway in log work
    assert table.last_source == "interpolated"
    assert fwd == pytest.approx(math.sqrt(1e-4 * 4e-4)) and bwd == pytest.approx(2 * fwd)
    found = table.explain(_mm(128, 64, 64))
    assert len(found.neighbours) == 2
    assert table.lookup(_mm(4096, 64, 64)) is None   # 16x beyond the largest: roofline
    assert table.last_source == "roofline"
    assert table.lookup(_node("g", "aten.gelu.default", [T((8, 8), "float32")],
                              [T((8, 8), "float32")])) is None
    assert table.counts == {"exact": 1, "interpolated": 2, "roofline": 2}


def test_op_table_looks_up_the_tp_shard():
    from autoplan.profile.lookup import OpTimeTable

    table = OpTimeTable(_table_profile())
    assert table.lookup(_mm(128, 32, 64, role="column"), shard=2) == (7e-5, 1.4e-4)
    assert table.last_source == "exact"
    assert table.lookup(_mm(128, 32, 64, role="column"), shard=0.5) == (7e-5, 1.4e-4)
    bf16 = OpTimeTable(_table_profile(), dtype="bfloat16")
    assert bf16.lookup(_mm(64, 64, 64)) is None


# ---- profiling ----------------------------------------------------------------------------

def _small_graph_nodes() -> list[OpNode]:
    x = T((4, 16, 32), "float32")
    return [
        _node("emb", "aten.embedding.default", [T((100, 32), "float32"), T((4, 16), "int64")], [x]),
        _node("fc", "aten.linear.default", [x, T((64, 32), "float32"), T((64,), "float32")],
              [T((4, 16, 64), "float32")], "column", 2.0 * 64 * 32 * 64),
        _node("act", "aten.gelu.default", [T((4, 16, 64), "float32")], [T((4, 16, 64), "float32")],
              "sharded"),
        _node("sm", "aten._softmax.default", [x], [x]),
    ]


def test_profiling_is_resumable_and_skips_done_signatures(tmp_path):
    from autoplan.profile.lookup import OpTimeTable
    from autoplan.profile.ops import profile_ops
    from autoplan.profile.timing import TimingConfig

    fast = TimingConfig(warmup=1, repeats=3, min_rep_s=1e-4)
    out = tmp_path / "cpu.json"
    nodes = _small_graph_nodes()
    first = profile_ops(nodes, out, tp_degrees=(1, 2), timing=fast, max_new=3, flush_every=1,
                        progress=False, device_name="cpu-test")
    assert (first.signatures, first.measured, first.complete) == (8, 3, False)
    assert len(OpProfile.load(out).entries) == 3
    second = profile_ops(nodes, out, tp_degrees=(1, 2), timing=fast, progress=False,
                         device_name="cpu-test")
    assert (second.skipped, second.measured, second.complete, second.failed) == (3, 5, True, {})
    third = profile_ops(nodes, out, tp_degrees=(1, 2), timing=fast, progress=False,
                        device_name="cpu-test")
    assert (third.skipped, third.measured) == (8, 0)
    prof = OpProfile.load(out)
    assert all(e.fwd_s > 0 and e.bwd_s is not None for e in prof.entries.values())
    assert next(iter(prof.sources.values()))["threads"] == 1
    table = OpTimeTable(prof)
    for node in nodes:
        for t in (1, 2):
            assert table.lookup(node, shard=t) is not None and table.last_source == "exact"
    with pytest.raises(ProfileError, match="field 'device'"):
        profile_ops(nodes[:1], out, timing=fast, progress=False, device_name="cuda-other")


def test_profile_cli_registers_commands():
    import argparse

    from autoplan.profile.cli import add_profile_commands, links_command

    parser = argparse.ArgumentParser()
    add_profile_commands(parser.add_subparsers())
    args = parser.parse_args(["profile", "ops", "gpt-tiny", "--batch-size", "1,2", "--tp", "1,2,4"])
    assert args.batch_size == [1, 2] and args.tp == [1, 2, 4] and callable(args.func)
    args = parser.parse_args(["profile", "links", "--nproc", "4", "--out", "x.json",
                              "--device", "cpu", "--group-sizes", "4"])
    cmd = links_command(args)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    assert cmd[cmd.index("--group-sizes") + 1] == "4" and "autoplan.profile.links" in cmd


def test_link_groups_by_level():
    from autoplan.profile.links import BenchConfig, plan_groups

    cfg = BenchConfig(out=Path("x.json"), cluster="x")
    two_nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan_groups(two_nodes, cfg) == [
        ("intra", (0, 1)), ("intra", (0, 1, 2, 3)),
        ("inter", (0, 4)), ("inter", (0, 1, 4, 5)), ("inter", tuple(range(8)))]
    assert plan_groups([0, 0, 0, 0], cfg) == [("intra", (0, 1)), ("intra", (0, 1, 2, 3))]


# ---- the link benchmark, 2 gloo ranks -----------------------------------------------------

@pytest.mark.multiproc
def test_link_benchmark_two_gloo_ranks(tmp_path):
    out = tmp_path / "links.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "autoplan.profile.links", "--out", str(out), "--device", "cpu",
           "--collectives", "all_reduce,send_recv", "--min-bytes", "1K", "--max-bytes", "64K",
           "--step", "4", "--time-budget", "10", "--repeats", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    prof = LinkProfile.load(out)
    assert prof.cluster == "links" and prof.backend == "gloo"
    assert prof.levels_present == ["intra"] and "one node" in prof.note
    assert {(p.collective, p.group_size, p.level) for p in prof.points} == {
        ("all_reduce", 2, "intra"), ("send_recv", 2, "intra")}
    assert sorted({p.bytes for p in prof.points}) == [1024, 4096, 16384, 65536]
    for p in prof.points:
        assert p.algbw_gbps == pytest.approx(p.bytes / p.time_s / 1e9)
        assert p.busbw_gbps == pytest.approx(p.algbw_gbps * bus_factor(p.collective, 2))
