"""Training data: deterministic per step, so the data position of a run is just its step.

A source yields, for optimiser step ``t`` (1-based), the global batch of ``global_batch``
sequences of ``seq_len + 1`` tokens (inputs are ``[:-1]``, targets ``[1:]``). Data-parallel
rank ``d`` takes rows ``[d * B/dp, (d+1) * B/dp)``; each rank materialises only its rows.
Because a batch depends only on ``(seed, step)``, resuming at step ``t`` needs no iterator
state, and every parallel layout sees exactly the batch a single process would.

* :class:`SyntheticTokens` (default): learnable arithmetic sequences
  ``x_i = (a + b·i) mod V`` with per-row random start ``a`` and stride ``b`` in [1, 8] — the
  loss falls quickly, so parity tests compare real learning, not noise around ln V.
* :class:`TokenFile`: a flat ``uint16`` token array (``.bin`` raw, or ``.npy``) opened with
  ``numpy.memmap``; each row is a window at a random offset drawn from ``(seed, step)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from autoplan.errors import ConfigError


class TokenSource(Protocol):
    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of step ``step``'s global batch: int64 (n, seq_len + 1)."""


class SyntheticTokens:
    def __init__(self, *, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.global_batch, self.seed = global_batch, seed

    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step])
        a = rng.integers(0, self.vocab_size, size=self.global_batch)[start:stop]
        b = rng.integers(1, 9, size=self.global_batch)[start:stop]
        i = np.arange(self.seq_len + 1)
        return torch.from_numpy((a[:, None] + b[:, None] * i[None, :]) % self.vocab_size)


class TokenFile:
    def __init__(self, path: str | Path, *, vocab_size: int, seq_len: int, global_batch: int,
                 seed: int):
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"token file not found: {path}", field="data")
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if tokens.dtype != np.uint16 or tokens.ndim != 1:
            raise ConfigError(f"{path}: expected a flat uint16 token array, got "
                              f"{tokens.dtype} with shape {tokens.shape}", field="data")
        if len(tokens) < seq_len + 2:
            raise ConfigError(f"{path}: {len(tokens)} tokens, fewer than one sequence of "
                              f"{seq_len + 1}", field="data")
        self.path, self.tokens = path, tokens
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.global_batch, self.seed = global_batch, seed

    def rows(self, step: int, start: int, stop: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step])
        offsets = rng.integers(0, len(self.tokens) - self.seq_len - 1,
                               size=self.global_batch)[start:stop]
        out = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1]) for o in offsets])
        if out.max(initial=0) >= self.vocab_size:
            raise ConfigError(f"{self.path}: token id {int(out.max())} >= the model's "
                              f"vocab_size {self.vocab_size}", field="data")
        return torch.from_numpy(out.astype(np.int64))


def make_source(data: str, *, vocab_size: int, seq_len: int, global_batch: int,
                seed: int) -> TokenSource:
    kwargs = dict(vocab_size=vocab_size, seq_len=seq_len, global_batch=global_batch, seed=seed)
    if data == "synthetic":
        return SyntheticTokens(**kwargs)
    return TokenFile(data, **kwargs)


def local_batch(source: TokenSource, step: int, *, dp: int, dp_rank: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's (inputs, targets) for ``step``."""
    per_rank = source.global_batch // dp
    rows = source.rows(step, dp_rank * per_rank, (dp_rank + 1) * per_rank).to(device)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
