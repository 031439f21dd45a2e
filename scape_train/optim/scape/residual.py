"""Where a rank's full-size residual lives: device memory, or host memory walked in chunks.

Both engines fold their residual the same way, in ONE pass over it:

    w ← w + e_{t-1};   e_t ← (1 - M_t) ⊙ w        (w = β1·m + (1-β1)·g, or (1-β1)·g when sharded)

The work is elementwise, so running it chunk by chunk through :class:`HostBuffer` (offload) gives
bit-identical ``w`` and ``e`` to running it on the whole device tensor. The returned ``||e||²``
(a metric) is summed chunk by chunk, so it agrees with the whole-tensor figure only to rounding.
"""

from __future__ import annotations

import torch

from .kernels import scatter_masked
from .offload import HostBuffer


def _sq_norm(chunk: torch.Tensor) -> torch.Tensor:
    """``||chunk||²`` for the residual-norm metric: the fp32 norm (a diagnostic, far from fp32's
    range) costs one read; an fp64 one converts every element first, ~70x slower on CPUs."""
    return torch.linalg.vector_norm(chunk).double().square()


class ResidualStore:
    def __init__(self, numel: int, device: torch.device, offload: bool, chunk_numel: int):
        self.numel, self.device, self.offload = numel, device, offload
        if offload:
            self._host = HostBuffer(numel, torch.float32, device, chunk_numel,
                                    pin=device.type == "cuda")
            self._dev = None
        else:
            self._host = None
            self._dev = torch.zeros(numel, dtype=torch.float32, device=device)
        self._deferred: torch.Tensor | None = None     # see defer_zero

    # -- the fused step's fold, deferred -------------------------------------------------------
    def defer_zero(self, idx: torch.Tensor) -> None:
        """``e[idx] = 0``, left to whoever reads ``e`` next. The fused replicated step's fold
        ``e = (1-M)⊙c``: its next prepare writes every position of ``idx`` (they are m's
        support) before reading it, so the fold's pass is skipped there (:meth:`overwriting`);
        every other reader (checkpoints, state, tests, the reference path) gets it applied."""
        assert self._host is None, "the fused step does not run on an offloaded residual"
        self._apply_deferred_zero()
        self._deferred = idx

    def overwriting(self, idx: torch.Tensor) -> torch.Tensor:
        """The residual, for a pass that writes ``e[idx]`` before reading it: a deferred zero at
        exactly ``idx`` is dropped (the pass overwrites it), any other is applied first."""
        if self._deferred is not idx:
            self._apply_deferred_zero()
        self._deferred = None
        return self._dev

    def _apply_deferred_zero(self) -> None:
        if self._deferred is not None:
            self._dev.index_fill_(0, self._deferred, 0.0)
            self._deferred = None

    def _each(self, fn, writeback: bool = True) -> None:
        if self._host is not None:
            self._host.for_each_chunk(fn, writeback=writeback)
        else:
            fn(0, self.numel, self._dev)

    def fold(self, w: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``w += e``; then, if ``mask`` is given, ``e = w`` off the mask and 0 on it.

        Returns ``||e_new||²`` as a float64 device tensor, not read on the host (0 when the mask
        was not given and ``e`` was only read).
        """
        self._apply_deferred_zero()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)

        def fn(s: int, e: int, chunk: torch.Tensor) -> None:
            w[s:e].add_(chunk)
            if mask is not None:
                chunk.copy_(w[s:e]).masked_fill_(mask[s:e], 0.0)
                sq.add_(_sq_norm(chunk))

        self._each(fn, writeback=mask is not None)
        return sq

    def set_from(self, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``e = (1 - M) ⊙ w`` (the first step, when the mask is known only after ``w``)."""
        self._deferred = None       # every position is written
        sq = torch.zeros((), dtype=torch.float64, device=self.device)

        def fn(s: int, e: int, chunk: torch.Tensor) -> None:
            chunk.copy_(w[s:e]).masked_fill_(mask[s:e], 0.0)
            sq.add_(_sq_norm(chunk))

        self._each(fn)
        return sq

    def set_masked(self, values: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
        """``e[M] = values`` (compact, in mask order; ``count`` ones) where ``e`` is 0 on the mask
        (after :meth:`fold` / :meth:`set_from`): a low-precision payload's quantization error.
        Returns ``||values||²`` (float64 device tensor), what ``||e||²`` grows by."""
        self._apply_deferred_zero()
        if self._host is None:
            scatter_masked(values, mask, self._dev, count=count)
        else:
            dense = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
            scatter_masked(values, mask, dense, count=count)

            def fn(s: int, e: int, chunk: torch.Tensor) -> None:
                chunk.copy_(torch.where(mask[s:e], dense[s:e], chunk))

            self._each(fn)
        return _sq_norm(values)

    def full(self) -> torch.Tensor:
        """A device copy of the whole residual (checkpoints, tests)."""
        self._apply_deferred_zero()
        if self._host is not None:
            return self._host.host.to(self.device, copy=True)
        return self._dev.clone()

    def tensor(self) -> torch.Tensor:
        """The residual itself, not copied: the device tensor, or the host buffer when offloaded
        (up to date between steps). Checkpoints write it as it is."""
        self._apply_deferred_zero()
        return self._host.wait_host().host if self._host is not None else self._dev

    def load(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel:
            raise ValueError(f"residual has {flat.numel()} elements, expected {self.numel}")
        self._deferred = None
        if self._host is not None:
            self._host.wait_host().host.copy_(flat.reshape(-1).cpu())
        else:
            self._dev.copy_(flat.reshape(-1))

    def zero_(self) -> None:
        self._deferred = None
        if self._host is not None:
            self._host.zero_()
        else:
            self._dev.zero_()
