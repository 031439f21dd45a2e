"""SCAPE's 1-bit masks: the packed format, argument checks, and the torch ops on them.

Masks travel as packed bits (spec §4): uint8, 8 elements per byte, little-endian bit order inside a
byte (element ``i`` is bit ``i % 8`` of byte ``i // 8``), the length padded to a multiple of 8 with
zero bits. The payload of a masked tensor is its values at the mask positions, in increasing index
order.

``pack_bits``/``unpack_bits`` here are the torch implementation of the passes' mask methods
(:class:`.torch_passes.TorchPasses`; the Triton ones are in :mod:`.triton_codecs`).
``gather_masked``/``scatter_masked`` serve the reference engines on every device: with the
popcount known they are ``nonzero_static`` and an index op, no host sync on a device either (the
fused step walks index lists instead, :mod:`.fused`).

Inputs may be of any shape (masks and values must have the same shape; they are flattened in
row-major order) and may be views with a storage offset.
"""

from __future__ import annotations

import functools

import torch


def nonzero_sorted(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The flat indices of the ``count`` ones of the 1-D bool ``mask``, increasing (the count
    known in advance: a fixed-size output, no host read on a device)."""
    return torch.nonzero_static(mask, size=count).view(-1)


SELECT_INDEX_BITS = 31     # the select key's index field: segments of fewer than 2^31 elements


def select_keys(x: torch.Tensor, rev: torch.Tensor) -> torch.Tensor:
    """The select's int64 keys of one segment ``x`` (fp32): ``(|x|'s float bits) << 31 |
    (2^31 - 1 - i)``, ``i`` the element's index in the segment (``rev``: ``2^31 - 1 - i`` for at
    least ``x.numel()`` indices). |x|'s bits order as |x| does (the sign cleared: -0 = +0; NaN
    above inf), and the index makes every key distinct: the ``k`` largest keys are the ``k``
    largest |x|, the lowest indices first among equal values."""
    key = (x.view(torch.int32) & 0x7FFFFFFF).to(torch.int64)
    return key.bitwise_left_shift_(SELECT_INDEX_BITS).bitwise_or_(rev[:x.numel()])


def topk_segments(stat: torch.Tensor, segments: tuple[tuple[int, int, int], ...]
                  ) -> torch.Tensor:
    """Bits (bool) over ``stat``: on each segment ``(start, numel, k)`` the ``k`` entries first
    in the order |stat| descending, then index ascending (-0 = +0, NaN above inf:
    :func:`select_keys`), all ones where ``k == numel``. One ``torch.topk`` of the int64 keys per
    segment (a radix select on a device, no host read): the rule of the Triton select
    (:mod:`.triton_select`), so the masks are the same on every device, ties included."""
    bits = torch.zeros(stat.numel(), dtype=torch.bool, device=stat.device)
    todo = [(a, n, k) for a, n, k in segments if k < n]
    longest = max((n for _, n, _ in todo), default=0)
    if longest >= 1 << SELECT_INDEX_BITS:
        raise ValueError(f"topk_segments: a segment of {longest} elements is too long for the "
                         f"select key's {SELECT_INDEX_BITS}-bit index; use a partition with "
                         f"segments under 2^{SELECT_INDEX_BITS} elements")
    x = stat if stat.dtype == torch.float32 else stat.float()   # fp32 keeps |stat|'s order
    rev = torch.arange((1 << SELECT_INDEX_BITS) - 1, (1 << SELECT_INDEX_BITS) - 1 - longest, -1,
                       dtype=torch.int64, device=stat.device) if todo else None
    for a, numel, k in segments:
        piece = bits[a:a + numel]
        if k >= numel:
            piece.fill_(True)
        else:
            keys = select_keys(x[a:a + numel], rev)
            piece.index_fill_(0, torch.topk(keys, k, sorted=False).indices, True)
    return bits


def packed_numel(n: int) -> int:
    """Bytes needed to pack ``n`` mask bits (``ceil(n / 8)``)."""
    if n < 0:
        raise ValueError(f"packed_numel: n must be >= 0, got {n}")
    return (n + 7) // 8


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when triton imports. Cached: import it once, after TRITON_INTERPRET is settled."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError on macOS/Windows; anything else means unusable too
        return False
    return True


# ----------------------------------------------------------------------------------------------
# argument checks (both implementations)


def check_mask(mask: torch.Tensor, name: str = "mask") -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}; use `{name}.bool()` or "
                        f"`{name} != 0`")


def check_packed(packed: torch.Tensor, n: int) -> None:
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
    for name, t in ((an, a), (bn, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"{an} and {bn} must have the same shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{an} and {bn} must be on the same device, got {a.device} and {b.device}")


def _check_payload(payload: torch.Tensor, out: torch.Tensor, count: int) -> None:
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    if payload.dim() != 1:
        raise ValueError(f"payload must be 1-D, got shape {tuple(payload.shape)}")
    if payload.dtype != out.dtype:
        raise TypeError(f"payload dtype {payload.dtype} != out dtype {out.dtype}; cast with "
                        f"payload.to(out.dtype)")
    if payload.device != out.device:
        raise ValueError(f"payload on {payload.device} but out on {out.device}")
    if payload.numel() != count:
        raise ValueError(f"payload has {payload.numel()} values but the mask has {count} ones; "
                         f"the payload length must equal the mask's popcount")


# ----------------------------------------------------------------------------------------------
# the torch ops


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask of ``n`` elements into ``ceil(n/8)`` uint8 bytes, little-endian bits."""
    check_mask(mask)
    flat = mask.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(packed_numel(n) * 8, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat.to(torch.uint8)
    # made on the device: a host-built constant would be a blocking copy on every call
    shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    # distinct bits never carry, so a uint8 sum is an exact bitwise OR
    return (padded.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a 1-D bool tensor of ``n`` elements (padding bits dropped)."""
    check_packed(packed, n)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:n].bool()


def gather_masked(values: torch.Tensor, mask: torch.Tensor, count: int | None = None
                  ) -> torch.Tensor:
    """The values at the mask positions, in increasing index order: 1-D, ``popcount(mask)`` long.

    ``count``: the mask's popcount when the caller knows it (SCAPE does, from the density
    schedule); then nothing is read back to the host. It must be exact: a wrong count gives a
    wrong payload, not an error (checking it would cost the sync it avoids).
    """
    check_mask(mask)
    _check_same(values, mask, "values", "mask")
    if count is None:
        # boolean indexing returns elements in increasing (row-major) index order; its output
        # size is data-dependent: a host sync on a device
        return values.reshape(-1)[mask.reshape(-1)]
    if count == mask.numel():    # a full mask: the gather is a copy (no int64 indices)
        return values.reshape(-1).clone()
    return values.reshape(-1).index_select(0, nonzero_sorted(mask.reshape(-1), count))


def scatter_masked(payload: torch.Tensor, mask: torch.Tensor, out: torch.Tensor,
                   count: int | None = None) -> torch.Tensor:
    """Write ``payload`` into ``out`` at the mask positions, in place; other entries untouched.

    ``payload`` is 1-D with one value per set bit, in increasing index order (the output of
    :func:`gather_masked`). Returns ``out``. ``count``: as in :func:`gather_masked` (given, the
    popcount is not checked against the data, so no host sync).
    """
    check_mask(mask)
    _check_same(out, mask, "out", "mask")
    _check_payload(payload, out, int(torch.count_nonzero(mask)) if count is None else count)
    if count is None or not out.is_contiguous():
        out[mask] = payload  # index_put_ on `out` itself (also when it is a view)
    elif count == mask.numel():    # a full mask: the scatter is a copy
        out.view(-1).copy_(payload)
    else:
        out.view(-1).index_copy_(0, nonzero_sorted(mask.reshape(-1), count), payload)
    return out
