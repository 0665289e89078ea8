"""Random stage-latency tables for the stage DP's brute-force checks (test_search.py,
test_search_fast_paths.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np


def random_stage_table(rng: np.random.Generator, density: float
                       ) -> tuple[np.ndarray, int, int]:
    """(t, v, m): a table t[position, start unit, end unit, devices] of 1-4 positions,
    units and device units, each entry finite with probability ``density`` (latency
    growing with the units and shrinking with the devices), and a micro-batch count m."""
    s, u, v = (int(x) for x in rng.integers(1, 5, size=3))
    t = np.full((s + 1, u, u + 1, v + 1), math.inf)
    for pos, i, n in itertools.product(range(1, s + 1), range(u), range(1, v + 1)):
        for j in range(i + 1, u + 1):
            if rng.random() < density:
                t[pos, i, j, n] = rng.random() * (j - i) / n + 0.05 * pos
    return t, v, int(rng.integers(1, 9))
