"""Peak tensor memory on CPU: a TorchDispatchMode counting live tensor storages.

CPU has no caching allocator with peak statistics, so the engine counts what CUDA's
``max_memory_allocated`` would: the bytes of every live tensor storage. ``LiveTensorMemory``
registers the storages that exist when it starts (parameters, gradients, optimizer states,
given by the caller), then every storage an op creates under it; a weak reference's callback
subtracts a storage when it is freed, and ``UntypedStorage.resize_`` (how FSDP2 frees and
re-allocates unsharded parameters) is followed while the mode is active. DTensor ops are let
through to run on their local shards first, so the shards are what is counted.

This is the counting core of ``torch.distributed._tools.mem_tracker.MemTracker`` without its
per-module attribution, which refuses a module called more than once per step (every
micro-batch of a pipeline calls the stage module again).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorMemory(TorchDispatchMode):
    """``with LiveTensorMemory(existing) as m: ...`` then ``m.peak`` / ``m.start`` (bytes)."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self._orig_resize = None
        for t in existing:
            self._track(t)
        self.start = self.current
        self.peak = self.current

    # ---- bookkeeping -------------------------------------------------------------------------
    def _key(self, st: torch.UntypedStorage) -> int:
        return id(st)

    def _on_free(self, key: int, _ref: Any = None) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _add_storage(self, st: torch.UntypedStorage) -> None:
        if st.device.type == "meta":
            return
        key = self._key(st)
        size = st.nbytes()
        if key in self._sizes:
            if self._refs[key]() is st:
                self.current += size - self._sizes[key]
                self._sizes[key] = size
                self.peak = max(self.peak, self.current)
                return
            self._on_free(key)          # id reused by a new storage
        self._sizes[key] = size
        self._refs[key] = weakref.ref(st, lambda ref, k=key: self._on_free(k, ref))
        self.current += size
        self.peak = max(self.peak, self.current)

    def _track(self, obj: Any) -> None:
        flat, _ = tree_flatten(obj)
        for t in flat:
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    self._add_storage(st)

    # ---- mode --------------------------------------------------------------------------------
    def __enter__(self) -> "LiveTensorMemory":
        self._orig_resize = torch.UntypedStorage.resize_
        tracker, orig = self, self._orig_resize

        def resize_(st: torch.UntypedStorage, size: int) -> None:
            orig(st, size)
            tracker._add_storage(st)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self._track(out)
        return out


def state_tensors(modules: Iterable[torch.nn.Module],
                  optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Parameters, gradients and optimizer states: what is live before a step starts."""
    out: list[torch.Tensor] = []
    for module in modules:
        for p in module.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out
