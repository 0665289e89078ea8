"""Profiles under concurrency (issue #7): many processes writing one profile file while another
reads it, and a writer killed in the middle of its write.

tests/test_profile.py has two writers adding 25 entries each; this adds six writers with a
reader checking every version it sees, and SIGKILL at the worst moment -- temp file written,
lock held, ``os.replace`` not yet done (autoplan.profile.files.locked_update).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

from autoplan.graph import TensorMeta
from autoplan.profile.store import OpEntry, OpProfile, add_op_entries
from fuzz_helpers import scratch_dir, time_limit

DEVICE = "cpu-test"


def _entry(tag: int, i: int) -> OpEntry:
    m = 1000 * tag + i + 1                           # a distinct signature per (writer, i)
    a, b, c = TensorMeta((m, 8), "float32"), TensorMeta((8, 8), "float32"), \
        TensorMeta((m, 8), "float32")
    return OpEntry(op="aten.mm.default", dtype="float32", inputs=(a, b), outputs=(c,),
                   fwd_s=1e-5, bwd_s=2e-5, repeats=3, flops=2.0 * m * 64,
                   bytes=a.nbytes + b.nbytes + c.nbytes, source=f"w{tag}")


def _add(path: str, tag: int, i: int) -> None:
    add_op_entries(path, DEVICE, [_entry(tag, i)], {f"w{tag}": {"kind": "measured",
                                                                 "writer": tag}})


def _writer(path: str, tag: int, count: int) -> None:
    for i in range(count):
        _add(path, tag, i)


def _reader(path: str, stop, results) -> None:
    """Load the file over and over until told to stop; report (loads, first error)."""
    loads, error = 0, None
    while not stop.is_set() and error is None:
        if os.path.exists(path):
            try:
                OpProfile.load(path)
                loads += 1
            except Exception as exc:  # noqa: BLE001 -- any failure is what this looks for
                error = f"{type(exc).__name__}: {exc}"
    results.put((loads, error))


def _temps(folder: Path) -> list[Path]:
    return sorted(folder.glob(".ops.json.*.tmp"))


def test_six_writers_and_a_reader_never_see_a_partial_file(tmp_path):
    ctx = mp.get_context("fork")
    with scratch_dir(tmp_path) as work:
        path = str(work / "ops.json")
        stop, results = ctx.Event(), ctx.Queue()
        reader = ctx.Process(target=_reader, args=(path, stop, results))
        reader.start()
        writers = [ctx.Process(target=_writer, args=(path, tag, 20)) for tag in range(1, 7)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(120)
            assert w.exitcode == 0
        stop.set()
        loads, error = results.get(timeout=60)
        reader.join(60)
        assert error is None, error
        assert loads > 0
        prof = OpProfile.load(path)
        assert len(prof.entries) == 120
        assert set(prof.sources) == {f"w{tag}" for tag in range(1, 7)}
        assert {e.source for e in prof.entries.values()} == set(prof.sources)
        assert not _temps(work)


def _killed_mid_write(path: str, replacing) -> None:
    """Write one entry, but stop for good just before the temp file replaces the profile."""
    import autoplan.plan

    def stall(src, dst):
        replacing.set()
        time.sleep(600)

    autoplan.plan.os.replace = stall      # this (forked) process only
    _add(path, 9, 0)


def test_a_writer_killed_mid_write_leaves_the_file_whole_and_the_lock_free(tmp_path):
    ctx = mp.get_context("fork")
    with scratch_dir(tmp_path) as work:
        path = work / "ops.json"
        _add(str(path), 1, 0)
        before = path.read_bytes()
        replacing = ctx.Event()
        victim = ctx.Process(target=_killed_mid_write, args=(str(path), replacing))
        victim.start()
        assert replacing.wait(60), "the writer never reached os.replace"
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
        assert victim.exitcode == -signal.SIGKILL
        # the profile is the previous version, whole; the dead writer's temp file is there
        assert path.read_bytes() == before
        assert len(OpProfile.load(path).entries) == 1
        assert len(_temps(work)) == 1
        # the kernel released its lock: the next writer gets in at once, and tidies up
        with time_limit(30):
            _add(str(path), 2, 0)
        prof = OpProfile.load(path)
        assert {e.source for e in prof.entries.values()} == {"w1", "w2"}
        assert not _temps(work)
