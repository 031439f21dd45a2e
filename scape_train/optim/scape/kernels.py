"""SCAPE's 1-bit mask kernels: pack, unpack, gather-masked and scatter-masked.

Masks travel as packed bits (spec §4): uint8, 8 elements per byte, little-endian bit order inside a
byte (element ``i`` is bit ``i % 8`` of byte ``i // 8``), the length padded to a multiple of 8 with
zero bits. The payload of a masked tensor is its values at the mask positions, in increasing index
order.

Every function takes ``backend``: ``"auto"`` (default), ``"torch"`` or ``"triton"``. ``auto`` uses
the Triton kernels for CUDA tensors when triton imports, and the pure-torch path otherwise
(``optimizer.use_triton=off`` rules Triton out). ``triton`` on CPU tensors works only under ``TRITON_INTERPRET=1``
(that is how the kernels are tested without a GPU). Both paths give bit-identical results: gather
and scatter copy raw element bits, they never do arithmetic on the values.

Inputs may be of any shape (masks and values must have the same shape; they are flattened in
row-major order) and may be views with a storage offset; non-contiguous inputs are copied once.
"""

from __future__ import annotations

import functools
import os

import torch

from .checks import check_payload_count

BACKENDS = ("auto", "torch", "triton")

# Little-endian bit weights inside a byte: element j of a group of 8 is bit j.


def nonzero_sorted(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The flat indices of the ``count`` ones of the 1-D bool ``mask``, increasing (the count
    known in advance: a fixed-size output, no host read on a device)."""
    return torch.nonzero_static(mask, size=count).view(-1)


def packed_numel(n: int) -> int:
    """Bytes needed to pack ``n`` mask bits (``ceil(n / 8)``)."""
    if n < 0:
        raise ValueError(f"packed_numel: n must be >= 0, got {n}")
    return (n + 7) // 8


# ----------------------------------------------------------------------------------------------
# backend selection


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when triton imports. Cached: import it once, after TRITON_INTERPRET is settled."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError on macOS/Windows; anything else means unusable too
        return False
    return True


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Pick ``"torch"`` or ``"triton"`` for these tensors (see module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        on_cuda = all(t.is_cuda for t in tensors)
        return "triton" if on_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton cannot be imported; "
                               "install triton (Linux) or use backend='torch'")
        interpreted = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
        if not all(t.is_cuda for t in tensors) and not interpreted:
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                               "triton is first imported; use backend='torch' on CPU")
    return backend


_triton_passes: dict[str, object] = {}


def select_passes(backend: str, device: torch.device):
    """The fused step's passes for tensors on ``device`` under ``backend``: the Triton ones
    (:class:`.triton_passes.TritonPasses`, one per device) where :func:`resolve_backend` picks
    Triton, else the torch ops (:class:`.torch_passes.TorchPasses`), also the oracle the kernels
    are tested against."""
    if resolve_backend(backend, torch.empty(0, device=device)) != "triton":
        from .torch_passes import TorchPasses

        return TorchPasses()
    key = str(device)
    if key not in _triton_passes:
        from .triton_passes import TritonPasses   # imports triton: only when chosen

        _triton_passes[key] = TritonPasses(torch.device(device))
    return _triton_passes[key]


def _triton():
    # Imported lazily so that this module imports without triton and so that TRITON_INTERPRET
    # set by a test's conftest is in place before triton is first imported.
    from . import triton_kernels

    return triton_kernels


# ----------------------------------------------------------------------------------------------
# validation


def _check_mask(mask: torch.Tensor, name: str = "mask") -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}; use `{name}.bool()` or "
                        f"`{name} != 0`")


def _check_packed(packed: torch.Tensor, n: int) -> None:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8 (output of pack_bits), got {packed.dtype}")
    if packed.dim() != 1:
        raise ValueError(f"packed must be 1-D, got shape {tuple(packed.shape)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if packed.numel() != packed_numel(n):
        raise ValueError(f"packed has {packed.numel()} bytes but n={n} bits need "
                         f"ceil(n/8)={packed_numel(n)}; slice the packed buffer per segment")


def _check_same(a: torch.Tensor, b: torch.Tensor, an: str, bn: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{an} and {bn} must have the same shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{an} and {bn} must be on the same device, got {a.device} and {b.device}")


def _check_payload(payload: torch.Tensor, out: torch.Tensor, count: int | None) -> None:
    """Shape/dtype/device checks; the popcount check too when ``count`` is given."""
    if payload.dim() != 1:
        raise ValueError(f"payload must be 1-D, got shape {tuple(payload.shape)}")
    if payload.dtype != out.dtype:
        raise TypeError(f"payload dtype {payload.dtype} != out dtype {out.dtype}; cast with "
                        f"payload.to(out.dtype)")
    if payload.device != out.device:
        raise ValueError(f"payload on {payload.device} but out on {out.device}")
    if count is not None:
        check_payload_count(payload.numel(), count)


# ----------------------------------------------------------------------------------------------
# pure-torch path (reference semantics; also the CPU path)


def _bit_shifts(device: torch.device) -> torch.Tensor:
    # made on the device: a host-built constant would be a blocking copy on every call
    return torch.arange(8, dtype=torch.uint8, device=device)


def _pack_torch(mask: torch.Tensor) -> torch.Tensor:
    flat = mask.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(packed_numel(n) * 8, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat.to(torch.uint8)
    shifts = _bit_shifts(flat.device)
    # distinct bits never carry, so a uint8 sum is an exact bitwise OR
    return (padded.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_torch(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = _bit_shifts(packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:n].bool()


def _gather_torch(values: torch.Tensor, mask: torch.Tensor, count: int | None = None
                  ) -> torch.Tensor:
    if count is None:
        # boolean indexing returns elements in increasing (row-major) index order; its output
        # size is data-dependent: a host sync on CUDA
        return values.reshape(-1)[mask.reshape(-1)]
    if count == mask.numel():    # a full mask: the gather is a copy (no int64 indices)
        return values.reshape(-1).clone()
    # the popcount known in advance: fixed-size indices (8 bytes each), no host sync
    idx = torch.nonzero_static(mask.reshape(-1), size=count).reshape(-1)
    return values.reshape(-1).index_select(0, idx)


def _scatter_torch(payload: torch.Tensor, mask: torch.Tensor, out: torch.Tensor,
                   count: int | None = None) -> torch.Tensor:
    if count is None or not out.is_contiguous():
        out[mask] = payload  # index_put_ on `out` itself (also when it is a view)
        return out
    if count == mask.numel():    # a full mask: the scatter is a copy
        out.view(-1).copy_(payload)
        return out
    idx = torch.nonzero_static(mask.reshape(-1), size=count).reshape(-1)
    out.view(-1).index_copy_(0, idx, payload)
    return out


# ----------------------------------------------------------------------------------------------
# public API


def pack_bits(mask: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Pack a bool mask of ``n`` elements into ``ceil(n/8)`` uint8 bytes, little-endian bits."""
    _check_mask(mask)
    if resolve_backend(backend, mask) == "triton":
        return _triton().pack_bits(mask)
    return _pack_torch(mask)


def unpack_bits(packed: torch.Tensor, n: int, *, backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a 1-D bool tensor of ``n`` elements (padding bits dropped)."""
    _check_packed(packed, n)
    if resolve_backend(backend, packed) == "triton":
        return _triton().unpack_bits(packed, n)
    return _unpack_torch(packed, n)


def gather_masked(values: torch.Tensor, mask: torch.Tensor, *, backend: str = "auto",
                  count: int | None = None) -> torch.Tensor:
    """The values at the mask positions, in increasing index order: 1-D, ``popcount(mask)`` long.

    ``count``: the mask's popcount when the caller knows it (SCAPE does, from the density
    schedule); then nothing is read back to the host. It must be exact: a wrong count gives a
    wrong payload, not an error (checking it would cost the sync it avoids).
    """
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    _check_mask(mask)
    _check_same(values, mask, "values", "mask")
    if resolve_backend(backend, values, mask) == "triton":
        return _triton().gather_masked(values, mask, count)
    return _gather_torch(values, mask, count)


def scatter_masked(payload: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, *,
                   backend: str = "auto", count: int | None = None) -> torch.Tensor:
    """Write ``payload`` into ``out`` at the mask positions, in place; other entries untouched.

    ``payload`` is 1-D with one value per set bit, in increasing index order (the output of
    :func:`gather_masked`). Returns ``out``. ``count``: as in :func:`gather_masked` (given, the
    popcount is not checked against the payload, so no host sync).
    """
    for name, t in (("payload", payload), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_mask(mask)
    _check_same(out, mask, "out", "mask")
    if count is not None:
        _check_payload(payload, out, count)
    if resolve_backend(backend, payload, mask, out) == "triton":
        _check_payload(payload, out, None)  # the kernel checks the count (it computes it anyway)
        return _triton().scatter_masked(payload, mask, out, count)
    if count is None:
        _check_payload(payload, out, int(torch.count_nonzero(mask)))
    return _scatter_torch(payload, mask, out, count)
