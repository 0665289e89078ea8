"""The ``autoplan`` command as a process: how often the garbage collector runs, and how the
process ends (issue #18: start-up and teardown are part of every command's time).

:func:`as_program` runs a command as the whole process (the console script, ``python -m
autoplan.cli``); :class:`CyclesPaused` pauses the cyclic collector around planning.
"""

from __future__ import annotations

import sys

#: the cyclic collector's first-generation threshold for the program: planning allocates
#: millions of short-lived acyclic objects (cost arrays, dicts), and the default (700)
#: runs a collection every 700 of them, about 0.7 CPU s of a GPT-39B plan (issue #18)
GC_THRESHOLD = 20_000
#: ... and its second-generation threshold (first-generation collections between two of
#: the second): the default (10) runs a second-generation collection every 200,000
#: allocations, each traversing what survived since the last -- torch's and the trace's
#: long-lived objects, 50 ms apiece, 0.15 CPU s of a GPT-39B plan (issue #18)
GC_THRESHOLD_1 = 100


def as_program(run) -> int:
    """``run()`` as the whole process: the collector runs less often (:data:`GC_THRESHOLD`,
    :data:`GC_THRESHOLD_1`), and the process ends with ``os._exit`` once the output is
    flushed and logging shut down, skipping the interpreter's teardown of torch's modules
    (about 0.6 CPU s of every command, issue #18). Every file a command writes is written
    atomically and closed before it returns; argparse's SystemExit (``--help``, a usage
    error) keeps its status."""
    import gc
    import logging
    import os

    gc.set_threshold(GC_THRESHOLD, GC_THRESHOLD_1, gc.get_threshold()[2])
    try:
        code = run()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


class CyclesPaused:
    """The cyclic garbage collector paused for a bounded computation, then restored:
    planning allocates about a million short-lived containers (cost arrays, dicts, tuples)
    and almost no reference cycles, so each collection finds nothing to free (issue #18:
    0.1-0.5 CPU s of a plan, GPT-39B to GPT 1T, for ~10 MB more peak memory)."""

    def __enter__(self) -> None:
        import gc

        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc) -> None:
        import gc

        if self._was:
            gc.enable()
