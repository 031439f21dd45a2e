"""The next mask's top-k as Triton kernels: every owner segment at once, in a fixed number of
launches whatever the number of tensors (the CUDA path of :func:`.masks.topk_own_mask`).

A segmented radix select on the key ``(|c| as its float bits) << 31 | (2^31 - 1 - i)``, ``i``
the element's index in its segment: |c|'s bits order as |c| does (sign cleared; NaN above inf),
and the index makes every key distinct, so the ``k`` largest keys are exactly ``k`` elements:
the ``k`` largest ``|c|``, and among equal values at the threshold the lowest indices: the rule
the torch path (:func:`.kernels.topk_segments`) follows too, so both give the same mask.

Launches (with the scratch's one zero fill), none sized by the data:
  1. ``hist``: a histogram of every segment's top 11 key bits (|c|'s bits 30..20) over its
     elements;
  2. ``pick``: per segment, the bin holding the k-th largest key: elements above it are in,
     below it out, the ``n`` in it are *undecided*;
  3. ``split``: writes every bit of the owner's range (in / out; all-ones segments: ones) and
     copies the undecided elements' |c| bits and indices into a compact buffer (``cap`` slots per
     segment, from the host-known ``k``; an atomic add per program reserves its slots);
  4-8. five levels over the undecided elements, 11 key bits each (the last 7): a histogram,
     and, in the next launch, the pick of its bin; only the compact buffer is read, by the
     programs whose slots hold some (the others return at once);
  9. ``mark``: the last pick gives the k-th largest key ``T`` exactly; the undecided elements
     with a key >= ``T`` get their bit.
A segment whose undecided elements do not fit its buffer (massive ties: a tensor of zeros) is
flagged by the pick on the device, and its levels read its elements in place instead: slower,
the same result, no host read.

Full-size traffic: two reads of ``c`` (4 B each), one write of the bits (1 B); the levels read
the undecided elements (about the bin's share of ``c``: well under 1% at SCAPE's densities).
Tested against the torch path under ``TRITON_INTERPRET=1`` (tests/test_triton_select.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...host_to_device import host_table, upload
from .counted_launch import launch
from .kernels import SELECT_INDEX_BITS

BLOCK = 8192           # elements per program (segment-aligned blocks)
NB = 2048              # bins per level (11 key bits)
NUM_WARPS = 8
# (shift, bits) of each level of the 62-bit key, the first over the elements, the rest over
# the undecided ones
LEVELS = ((51, 11), (40, 11), (29, 11), (18, 11), (7, 11), (0, 7))
NLEV = tl.constexpr(len(LEVELS))
IDX_BITS = SELECT_INDEX_BITS      # the key's index field (the torch path's too)

# segment table columns (int64): first element in the owner's range, numel, k (numel: all
# ones), the buffer's first slot, its slots
SEG_COLS = ("START", "NUMEL", "K", "BUF", "CAP")
START, NUMEL, K, BUF, CAP = (tl.constexpr(i) for i in range(len(SEG_COLS)))
NSEG_COL = tl.constexpr(len(SEG_COLS))
# per-segment state (int64), one row per level: the key prefix chosen so far, the keys still
# needed inside it; row 0 also the undecided count and the overflow flag
ST_PREFIX, ST_NEED, ST_UND, ST_OVER = (tl.constexpr(i) for i in range(4))
ST_COLS = tl.constexpr(4)


# ----------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _seg(segs, s, col: tl.constexpr):
    return tl.load(segs + s * NSEG_COL + col)


@triton.jit
def _abs_bits(x):
    """|x|'s float bits as a non-negative int64 (their order is |x|'s; NaN above inf)."""
    return (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _key(u, i):
    return (u << 31) | (0x7FFFFFFF - i)


@triton.jit
def _hist_add(hist_row, digit, keep, NBINS: tl.constexpr):
    """Add the histogram of ``digit`` over the ``keep`` lanes into ``hist_row`` (int32)."""
    d = tl.where(keep, digit, 0).to(tl.int32)
    h = tl.histogram(d, NBINS)
    bins = tl.arange(0, NBINS)
    # the masked lanes counted in bin 0 (tl.histogram's mask argument is not in every Triton)
    h = h - tl.where(bins == 0, tl.sum(1 - keep.to(tl.int32), axis=0), 0)
    tl.atomic_add(hist_row + bins, h, mask=h != 0, sem="relaxed")


@triton.jit
def _pick(hist_row, need, NBINS: tl.constexpr):
    """The bin holding the ``need``-th largest key of a histogram: ``(bin, keys above it,
    keys in it)``."""
    bins = tl.arange(0, NBINS)
    h = tl.load(hist_row + bins).to(tl.int64)
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h          # keys in this bin or above
    b = tl.max(tl.where(ge >= need, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > b, h, 0), axis=0)
    return b, above, tl.sum(tl.where(bins == b, h, 0), axis=0)


@triton.jit
def _block(blocks):
    """This program's segment, first element and end (in the owner's range)."""
    pid = tl.program_id(0)
    return (tl.load(blocks + 3 * pid), tl.load(blocks + 3 * pid + 1),
            tl.load(blocks + 3 * pid + 2))


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _hist_kernel(stat, blocks, segs, hist, BLOCK: tl.constexpr, NB: tl.constexpr):
    """Level 0: the histogram of |c|'s bits 30..20 over a block of a top-k segment."""
    s, first, end = _block(blocks)
    offs = first + tl.arange(0, BLOCK).to(tl.int64)
    keep = (offs < end) & (_seg(segs, s, K) < _seg(segs, s, NUMEL))
    u = _abs_bits(tl.load(stat + offs, mask=keep, other=0.0))
    _hist_add(hist + s * NLEV * NB, u >> 20, keep, NB)


@triton.jit
def _pick_kernel(segs, hist, state, NB: tl.constexpr):
    """Level 0's pick, one program per segment: the prefix bin, the keys still needed in it,
    how many keys it holds (the undecided), whether they overflow the segment's buffer."""
    s = tl.program_id(0)
    k = _seg(segs, s, K)
    b, above, inside = _pick(hist + s * NLEV * NB, k, NB)
    row = state + s * NLEV * ST_COLS
    tl.store(row + ST_PREFIX, b.to(tl.int64) << 51)
    tl.store(row + ST_NEED, k - above)
    tl.store(row + ST_UND, inside)
    tl.store(row + ST_OVER, (inside > _seg(segs, s, CAP)).to(tl.int64))


@triton.jit
def _split_kernel(stat, blocks, segs, state, counters, bits, buf_u, buf_i,
                  BLOCK: tl.constexpr):
    """Every bit of a block: above level 0's bin in, below out (all-ones segments: in); the
    undecided elements' bits and indices into the segment's buffer."""
    s, first, end = _block(blocks)
    offs = first + tl.arange(0, BLOCK).to(tl.int64)
    inside = offs < end
    start, numel, k = _seg(segs, s, START), _seg(segs, s, NUMEL), _seg(segs, s, K)
    if k >= numel:
        tl.store(bits + offs, tl.full((BLOCK,), 1, tl.uint8), mask=inside)
    else:
        row = state + s * NLEV * ST_COLS
        u = _abs_bits(tl.load(stat + offs, mask=inside, other=0.0))
        top, b = u >> 20, tl.load(row + ST_PREFIX) >> 51
        tl.store(bits + offs, (top > b).to(tl.uint8), mask=inside)
        und = inside & (top == b) & (tl.load(row + ST_OVER) == 0)
        n = tl.sum(und.to(tl.int64), axis=0)
        at = tl.atomic_add(counters + s, n, sem="relaxed")
        slot = _seg(segs, s, BUF) + at + tl.cumsum(und.to(tl.int64), axis=0) - und
        tl.store(buf_u + slot, u.to(tl.int32), mask=und)
        tl.store(buf_i + slot, (offs - start).to(tl.int32), mask=und)


@triton.jit
def _works(blocks, segs, state):
    """Whether this program has undecided keys to look at: its block's slots of the segment's
    buffer hold some, or the buffer overflowed (the segment's first program always works: it
    stores the segment's pick). Most programs of a level have none and return at once."""
    s, first, end = _block(blocks)
    start = _seg(segs, s, START)
    row = state + s * NLEV * ST_COLS
    topk = _seg(segs, s, K) < _seg(segs, s, NUMEL)
    return topk & ((first - start < tl.load(row + ST_UND)) | (tl.load(row + ST_OVER) != 0))


@triton.jit
def _undecided(stat, blocks, segs, state, buf_u, buf_i, BLOCK: tl.constexpr):
    """This program's undecided keys: its block's slots of the segment's buffer, or (the
    buffer overflowed) its block's elements in level 0's bin; and where they are."""
    s, first, end = _block(blocks)
    start = _seg(segs, s, START)
    row = state + s * NLEV * ST_COLS
    lane = tl.arange(0, BLOCK).to(tl.int64)
    if tl.load(row + ST_OVER) != 0:
        offs = first + lane
        keep = offs < end
        u = _abs_bits(tl.load(stat + offs, mask=keep, other=0.0))
        keep = keep & ((u >> 20) == (tl.load(row + ST_PREFIX) >> 51))
        i = offs - start
    else:
        j = first - start + lane                      # the block's slots of the buffer
        keep = j < tl.load(row + ST_UND)
        slot = _seg(segs, s, BUF) + j
        u = tl.load(buf_u + slot, mask=keep, other=0).to(tl.int64)
        i = tl.load(buf_i + slot, mask=keep, other=0).to(tl.int64)
    return s, first, start, _key(u, i), i, keep


@triton.jit
def _prefix_at(segs, hist, state, s, first, LEVEL: tl.constexpr, SHIFT: tl.constexpr,
               NB: tl.constexpr):
    """The key prefix after level ``LEVEL`` (its key bits start at ``SHIFT``; ``LEVEL`` > 0:
    picked here from its histogram and the previous level's row; the segment's first program
    stores it for the next launch)."""
    row = state + s * NLEV * ST_COLS
    if LEVEL == 0:
        prefix = tl.load(row + ST_PREFIX)
    else:
        prev = row + (LEVEL - 1) * ST_COLS
        b, above, _ = _pick(hist + (s * NLEV + LEVEL) * NB, tl.load(prev + ST_NEED), NB)
        prefix = tl.load(prev + ST_PREFIX) | (b.to(tl.int64) << SHIFT)
        if first == _seg(segs, s, START):
            here = row + LEVEL * ST_COLS
            tl.store(here + ST_PREFIX, prefix)
            tl.store(here + ST_NEED, tl.load(prev + ST_NEED) - above)
    return prefix


@triton.jit
def _level_kernel(stat, blocks, segs, state, hist, buf_u, buf_i, LEVEL: tl.constexpr,
                  SHIFT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                  NB: tl.constexpr):
    """Level ``LEVEL`` >= 1 (key bits ``SHIFT`` .. ``SHIFT + WIDTH - 1``): the previous
    level's pick, then the histogram of this level's bits over the undecided keys that match
    its prefix."""
    if _works(blocks, segs, state):
        s, first, start, key, i, keep = _undecided(stat, blocks, segs, state, buf_u, buf_i,
                                                   BLOCK)
        prefix = _prefix_at(segs, hist, state, s, first, LEVEL - 1, SHIFT + WIDTH, NB)
        keep = keep & ((key >> (SHIFT + WIDTH)) == (prefix >> (SHIFT + WIDTH)))
        digit = (key >> SHIFT) & ((1 << WIDTH) - 1)
        _hist_add(hist + (s * NLEV + LEVEL) * NB, digit, keep, NB)


@triton.jit
def _mark_kernel(stat, blocks, segs, state, hist, buf_u, buf_i, bits, BLOCK: tl.constexpr,
                 NB: tl.constexpr):
    """The last pick gives the k-th largest key T: the undecided keys >= T get their bit."""
    if _works(blocks, segs, state):
        s, first, start, key, i, keep = _undecided(stat, blocks, segs, state, buf_u, buf_i,
                                                   BLOCK)
        t = _prefix_at(segs, hist, state, s, first, NLEV - 1, 0, NB)
        tl.store(bits + start + i, tl.full((BLOCK,), 1, tl.uint8), mask=keep & (key >= t))


# ----------------------------------------------------------------------------------------------
# host side


class SelectPlan:
    """The tables of one owner's top-k at one density: its segments ``(start in the owner's
    range, numel, k)`` (``k == numel``: all ones) and their segment-aligned blocks; uploaded
    once, reused every step at that density."""

    def __init__(self, segments: list[tuple[int, int, int]], device: torch.device):
        rows, blocks, buf = [], [], 0
        for s, (start, numel, k) in enumerate(segments):
            if numel >= 1 << IDX_BITS:
                raise ValueError(f"a segment of {numel} elements: the Triton top-k takes "
                                 f"fewer than 2^{IDX_BITS}; set optimizer.use_triton=off")
            cap = 0 if k >= numel else min(numel, 2 * k + 1024)
            rows.append((start, numel, k, buf, cap))
            buf += cap
            blocks += [(s, a, min(a + BLOCK, start + numel))
                       for a in range(start, start + numel, BLOCK)]
        self.nseg, self.nblocks, self.slots = len(rows), len(blocks), buf
        self.total = sum(n for _, n, _ in segments)
        self.segs = upload(host_table(rows).reshape(-1), device)
        self.blocks = upload(host_table(blocks).reshape(-1), device)
        sel = [(n, k) for _, n, k in segments if k < n]
        tab = 8 * (5 * self.nseg + 3 * self.nblocks)
        topn = sum(n for n, _ in sel)
        # bytes per launch: tables, then what the launch's tasks read and write
        # (the buffers' slots as if full: an upper bound; a histogram once per segment: its
        # atomic adds land in a table of 8 KB)
        hists = 4 * NB * self.nseg
        self.bytes = {"topk_hist": tab + 4 * topn + hists,
                      "topk_pick": tab + hists + 32 * self.nseg,
                      "topk_split": tab + 5 * topn + (self.total - topn) + 8 * buf,
                      "topk_level": tab + 8 * buf + 2 * hists,
                      "topk_mark": tab + 8 * buf + hists + sum(k for _, k in sel)}


def topk_mask(plan: SelectPlan, stat: torch.Tensor) -> torch.Tensor:
    """The owner's bits (bool, ``plan.total``) of the ``k`` largest ``|stat|`` per segment."""
    dev = stat.device
    stat = stat.contiguous()
    bits = torch.empty(plan.total, dtype=torch.bool, device=dev)
    if not plan.nblocks:
        return bits
    # one zero fill: the histograms of every level, then the buffers' slot counters
    scratch = torch.zeros(plan.nseg * (NLEV * NB + 2), dtype=torch.int32, device=dev)
    hist = scratch[:plan.nseg * NLEV * NB]
    counters = scratch[plan.nseg * NLEV * NB:].view(torch.int64)
    state = torch.empty(plan.nseg * len(LEVELS) * 4, dtype=torch.int64, device=dev)
    # the undecided elements: |c|'s bits and the index in the segment (both below 2^31)
    buf_u = torch.empty(max(plan.slots, 1), dtype=torch.int32, device=dev)
    buf_i = torch.empty(max(plan.slots, 1), dtype=torch.int32, device=dev)
    out = bits.view(torch.uint8)
    grid, nb, w = (plan.nblocks,), plan.bytes, dict(num_warps=NUM_WARPS)
    launch(_hist_kernel, grid, "topk_hist", nb["topk_hist"], stat, plan.blocks, plan.segs,
           hist, BLOCK=BLOCK, NB=NB, **w)
    launch(_pick_kernel, (plan.nseg,), "topk_pick", nb["topk_pick"], plan.segs, hist, state,
           NB=NB, **w)
    launch(_split_kernel, grid, "topk_split", nb["topk_split"], stat, plan.blocks, plan.segs,
           state, counters, out, buf_u, buf_i, BLOCK=BLOCK, **w)
    for level, (shift, width) in enumerate(LEVELS[1:], 1):
        launch(_level_kernel, grid, "topk_level", nb["topk_level"], stat, plan.blocks,
               plan.segs, state, hist, buf_u, buf_i, LEVEL=level, SHIFT=shift, WIDTH=width,
               BLOCK=BLOCK, NB=NB, **w)
    launch(_mark_kernel, grid, "topk_mark", nb["topk_mark"], stat, plan.blocks, plan.segs,
           state, hist, buf_u, buf_i, out, BLOCK=BLOCK, NB=NB, **w)
    return bits
