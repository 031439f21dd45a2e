"""A dispatch mode that counts the bytes of live tensor storages, and their peak.

Every tensor an op returns while the mode is active is registered by its storage (views share
one, so they count once); a weak reference to the storage removes its bytes when the storage is
freed. Works on real tensors and on fake ones (``FakeTensorMode``: shapes only, no compute), which
is how the plan traces a forward+backward of a full-size micro-batch in seconds.

Each storage is charged to the *category* current at its creation (``tracker.category = ...``),
so the peak can be broken down: parameters, activations, logits/loss, backward temporaries.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from functools import partial
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK = 512


class LiveBytes(TorchDispatchMode):
    def __init__(self, round_to: int = 1) -> None:
        super().__init__()
        self.round_to = round_to
        self.category = "untagged"
        self.live = 0
        self.peak = 0
        self.by_category: dict[str, int] = defaultdict(int)
        self.peak_by_category: dict[str, int] = {}
        self.ops = 0
        self.peak_op = 0
        # id(storage) -> (weakref, bytes, category, op index at creation)
        self._storages: dict[int, tuple[weakref.ref, int, str, int]] = {}

    # -- registration --------------------------------------------------------------------------
    def storage_bytes(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        return -(-n // self.round_to) * self.round_to

    def track(self, tensors: Iterable[Any], category: str | None = None) -> None:
        """Register tensors that exist already (parameters, pre-allocated gradients)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t, category or self.category)

    def _register(self, t: torch.Tensor, category: str) -> None:
        st = t.untyped_storage()
        key = id(st)
        known = self._storages.get(key)
        if known is not None and known[0]() is st:
            return
        n = self.storage_bytes(st)
        ref = weakref.ref(st, partial(self._freed, key))
        self._storages[key] = (ref, n, category, self.ops)
        self.live += n
        self.by_category[category] += n
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, self.ops
            self.peak_by_category = dict(self.by_category)

    def _freed(self, key: int, ref: weakref.ref) -> None:
        entry = self._storages.get(key)
        if entry is None or entry[0] is not ref:
            return
        del self._storages[key]
        self.live -= entry[1]
        self.by_category[entry[2]] -= entry[1]

    def created_at(self, t: torch.Tensor) -> int | None:
        """The op index at which ``t``'s storage was registered (None: not tracked)."""
        entry = self._storages.get(id(t.untyped_storage()))
        return None if entry is None else entry[3]

    # -- the mode ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t, self.category)
        return out
