"""SCAPE's C loops on threads (``native/scape_cpu.c``): everything they write, and every sum they
return, is the same bit for bit on any thread count.

Sizes are above the loops' cutoffs, so 2, 3 and 5 threads really split the work: the k-sized
passes run in jobs of ``SUM_BLOCK`` = 2^16 index-list entries (k > 5 blocks here, and the
segment tables' rows end inside blocks), the top-k in parts of at least ``MIN_PER_THREAD`` =
2^18 entries (n > 5 parts here).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from scape_train.optim.scape import native
from scape_train.optim.scape.masks import _top_k_bits_native

LIB = native.lib(torch.zeros(1))
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler: the torch path runs")

THREADS = (1, 2, 3, 5)
SUM_BLOCK = 1 << 16
MIN_PER_THREAD = 1 << 18


def _with_threads(t: int, fn):
    """``fn()`` on ``t`` of torch's threads: the C loops take torch's count (native's wrapper)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(t)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


def _same_on_every_count(run) -> list:
    """``run()`` on each thread count; each result (tensors and floats) equal to 1 thread's."""
    outs = [_with_threads(t, run) for t in THREADS]
    for t, out in zip(THREADS[1:], outs[1:]):
        for a, b in zip(outs[0], out):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{t} threads"
            else:
                assert a == b, f"{t} threads: {a!r} != {b!r}"   # not approx: bit for bit
    return outs[0]


# -- top-k -------------------------------------------------------------------------------------

def _topk_reference(c: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |c|, ties at the k-th value to the lower indices."""
    a = c.abs()
    kth = torch.topk(a, k).values.min()
    bits = a > kth
    eq = torch.nonzero(a == kth).view(-1)
    bits[eq[:k - int(bits.sum())]] = True
    return bits


def _topk_bits(c: torch.Tensor, k: int) -> torch.Tensor:
    bits = torch.zeros(c.numel(), dtype=torch.bool)
    assert _top_k_bits_native(LIB, c, k, bits)
    return bits


def _ties_across_parts(n: int, k: int, seed: int) -> torch.Tensor:
    """k/2 entries of |c| = 2 and k of |c| = 1 at random positions, the rest small: the k-th
    value is 1, with k ties spread over every part, of which the lower half is taken."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n, generator=g) * 0.01
    pos = torch.randperm(n, generator=g)
    c[pos[:k // 2]] = 2.0
    c[pos[k // 2:k // 2 + k]] = -1.0
    return c


@pytest.mark.parametrize("dist", ["ties", "quantized", "outlier"])
def test_top_k_bits_are_the_same_on_any_number_of_threads(dist):
    n, k = 5 * MIN_PER_THREAD + 54_321, 150_000
    g = torch.Generator().manual_seed(7)
    if dist == "ties":
        c = _ties_across_parts(n, k, 8)
    elif dist == "quantized":       # thousands of ties at the k-th value, a threshold below it
        c = torch.round(torch.randn(n, generator=g) * 64) / 64
        k = int((c.abs() > 1.75).sum() + (c.abs() == 1.75).sum() // 2)    # half the ties
    else:                           # the first part holds more candidates than its room
        c = torch.randn(n, generator=g)
        c[: n // 10] *= 100
    want = _topk_reference(c, k)
    kth = float(c.abs()[want].min())
    ties = torch.nonzero(c.abs() == kth).view(-1)
    if dist != "outlier":           # the ties span the parts, the taken ones end inside one
        parts = [((ties >= n * w // 5) & (ties < n * (w + 1) // 5)).sum() for w in range(5)]
        assert all(p > 0 for p in parts)
        last_taken = int(ties[k - int((c.abs() > kth).sum()) - 1])
        assert n // 5 < last_taken < 4 * n // 5
    got = _same_on_every_count(lambda: (_topk_bits(c, k),))[0]
    assert torch.equal(got, want)


def test_top_k_bits_decline_alike_on_any_number_of_threads():
    n, k = 3 * MIN_PER_THREAD + 3, 60_000
    c = torch.randn(n, generator=torch.Generator().manual_seed(9))
    c[n - 5] = float("nan")                    # in the last part only
    for t in THREADS:
        bits = torch.zeros(n, dtype=torch.bool)
        assert not _with_threads(t, lambda: _top_k_bits_native(LIB, c, k, bits))
        assert not bits.any()


# -- the k-sized passes ------------------------------------------------------------------------

N = 1_300_007                   # the flat space
K = 5 * SUM_BLOCK + 12_345      # index-list entries: 6 blocks


def _index_list(seed: int, k: int = K, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(n, generator=g)[:k]).values


def _segments(idx: torch.Tensor, cuts: list[int]):
    """The index list cut at flat positions ``cuts`` into tensors: (offset, numel, a, b)."""
    bounds = [0] + cuts + [N]
    rows = []
    for off, end in zip(bounds, bounds[1:]):
        a = int(torch.searchsorted(idx, off))
        b = int(torch.searchsorted(idx, end))
        rows.append((off, end - off, a, b))
    return rows


def test_the_overlap_bitmap_is_marked_whole_across_block_boundaries():
    """The mark pass splits the index list into blocks that share no byte of the bitmap: runs of
    consecutive indices (8 to a byte) across block boundaries, starting mid-byte, are all
    counted, on any number of threads."""
    dense = torch.arange(3, 3 * SUM_BLOCK + 11, dtype=torch.int64)   # every byte shared
    every_other = dense[::2].clone()
    n = int(dense[-1]) + 1

    def run():
        out = []
        for a, b in ((dense, dense), (dense, every_other), (every_other, dense)):
            bits = torch.empty(n // 8 + 16, dtype=torch.uint8)
            out.append(LIB.scape_count_common(native.ptr(a), a.numel(), native.ptr(b),
                                              b.numel(), native.ptr(bits), bits.numel()))
        return out

    assert _same_on_every_count(run) == [dense.numel(), every_other.numel(),
                                         every_other.numel()]


CUTS = [200_003, 200_011, 777_777, 1_000_000]   # a tensor holding a few entries, rows mid-block


def test_gather_take_ghat_count_common_are_the_same_on_any_number_of_threads():
    g = torch.Generator().manual_seed(11)
    idx = _index_list(12)
    src0, m, rho0 = (torch.randn(N, generator=g) for _ in range(3))
    b0 = torch.randn(K, generator=g)
    prev = _index_list(13, k=K // 2)             # another mask's indices (the overlap metric)

    def run():
        vals = torch.empty(K)
        sq_g = LIB.scape_gather(K, native.ptr(idx), 0, native.ptr(src0), native.ptr(vals))
        src, took = src0.clone(), torch.empty(K)
        sq_t = LIB.scape_take(K, native.ptr(idx), native.ptr(src), native.ptr(took))
        b, rho, mc = b0.clone(), rho0.clone(), torch.empty(K)
        sq_h = LIB.scape_ghat(K, native.ptr(idx), 0, native.ptr(b), native.ptr(rho),
                              native.ptr(m), native.ptr(mc), 0.9, 0.1)
        b2 = b0.clone()
        sq_h2 = LIB.scape_ghat(K - 7, native.ptr(idx[7:]), 5, native.ptr(b2), None,
                               native.ptr(m), None, 0.9, 0.1)
        bits = torch.empty(N // 8 + 16, dtype=torch.uint8)
        n = LIB.scape_count_common(native.ptr(idx), K, native.ptr(prev), prev.numel(),
                                   native.ptr(bits), bits.numel())
        b3, m_at = b0.clone(), m[idx]            # the old m read from where it was gathered
        sq_h3 = LIB.scape_ghat(K, None, 0, native.ptr(b3), None, None, native.ptr(m_at), 0.9,
                               0.1)
        return vals, sq_g, src, took, sq_t, b, rho, mc, sq_h, b2, sq_h2, n, b3, sq_h3

    (vals, sq_g, src, took, sq_t, b, rho, mc, sq_h, b2, sq_h2, n, b3,
     sq_h3) = _same_on_every_count(run)
    assert torch.equal(b3, (m[idx] * -0.9 + b0) / torch.tensor(0.1))
    assert sq_h3 == pytest.approx(float(b3.double().square().sum()), rel=1e-13)
    assert torch.equal(vals, src0[idx]) and torch.equal(took, vals)
    want_src = src0.clone()
    want_src[idx] = 0.0
    assert torch.equal(src, want_src)
    ghat = (m[idx] * -0.9 + (b0 + rho0[idx])) / torch.tensor(0.1)
    assert torch.equal(b, ghat)
    assert torch.equal(mc, m[idx])                 # the old momentum at the mask, for AdamS
    want_rho = rho0.clone()
    want_rho[idx] = 0.0
    assert torch.equal(rho, want_rho)
    assert torch.equal(b2[:K - 7], (m[idx[7:] - 5] * -0.9 + b0[:K - 7]) / torch.tensor(0.1))
    both = torch.zeros(N, dtype=torch.int8)
    both[idx] += 1
    both[prev] += 1
    assert n == int((both == 2).sum()) > 0
    for sq, v in [(sq_g, vals), (sq_t, vals), (sq_h, ghat)]:
        assert sq == pytest.approx(float(v.double().square().sum()), rel=1e-13)
    # the blocked order: each block of 2^16 entries summed in order, the blocks in order
    d = ghat.double()
    blocked = 0.0
    for a in range(0, K, SUM_BLOCK):
        part = 0.0
        for x in d[a:a + SUM_BLOCK].square().tolist():
            part += x
        blocked += part
    assert sq_h == blocked


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("bias", [0, 1, 2])
def test_adams_and_scatter_are_the_same_on_any_number_of_threads(sharded, bias):
    g = torch.Generator().manual_seed(13 + bias)
    idx = _index_list(14)
    rows = _segments(idx, CUTS)
    theta0 = [torch.randn(numel, generator=g) for _, numel, _, _ in rows]
    m0 = torch.randn(N, generator=g) * 0.1
    ghat0 = torch.randn(K, generator=g)
    old = _index_list(15, k=K - 999)          # m's old support, overlapping the new mask
    j0 = 4_321 if sharded else 0              # an owner's slice of the index list
    k = K - j0 - 777
    base = 0
    kz = -1 if bias == 2 else old.numel()     # m zeroed everywhere, or on its old support
    coef, clip = 0.75, bias != 1
    # the weight decay per tensor: one without (1.0), one with a tiny factor, the rest 1 - 1e-3
    decay = [1.0, 0.5] + [1.0 - 1e-3] * (len(rows) - 2)
    bits = [int(torch.tensor(d).view(torch.int32)) for d in decay]

    def run():
        theta = [p.clone() for p in theta0]
        m, ghat = m0.clone(), ghat0[j0:j0 + k].clone()
        mc = m0[idx[j0:j0 + k]]                # the old momentum at the mask (scape_ghat's)
        ttab = native.table([[p.data_ptr(), off, max(a, j0), min(b, j0 + k), 0, numel, d]
                             for p, (off, numel, a, b), d in zip(theta, rows, bits)
                             if max(a, j0) < min(b, j0 + k)], 7)
        out = torch.full((k,), float("nan")) if sharded else None
        LIB.scape_adams(native.ptr(idx), j0, k, base, native.ptr(ghat), native.ptr(m), N,
                        native.ptr(old), kz, native.ptr(ttab), ttab.shape[0], native.ptr(out),
                        native.ptr(mc), coef, int(clip), 0.9, 0.95, 0.1, 0.05, 0.8,
                        math.sqrt(0.7), 1e-8, -1e-3, bias)
        scattered = [p.clone() for p in theta0]
        vals = torch.randn(K, generator=torch.Generator().manual_seed(16))
        stab = native.table([[p.data_ptr(), off, a, b, a, 0, numel, d] for p, (off, numel, a, b), d
                             in zip(scattered, rows, bits) if a < b], 8)
        LIB.scape_scatter_params(native.ptr(idx), native.ptr(stab), stab.shape[0],
                                 native.ptr(vals))
        return (*theta, m, ghat, *([out] if sharded else []), *scattered)

    got = _same_on_every_count(run)
    nt = len(rows)
    theta, m, ghat = got[:nt], got[nt], got[nt + 1]
    decayed = torch.cat([p * d for p, d in zip(theta0, decay)])   # θ·(1 - lr·wd), torch's ops
    # against torch's ops (sqrt within an ulp: torch's vectorized sqrt is not correctly rounded)
    sl = idx[j0:j0 + k]
    gg = ghat0[j0:j0 + k] * coef if clip else ghat0[j0:j0 + k]
    mc = m0[sl]
    prev = mc / torch.tensor(0.8) if bias == 2 else mc
    v = prev * prev * 0.95 + (gg * 0.05) * gg
    mn = mc * 0.9 + gg * 0.1
    den = v.sqrt() / torch.tensor(math.sqrt(0.7)) if bias == 1 else v.sqrt()
    upd = (mn * -1e-3) / (den + 1e-8)
    assert torch.equal(ghat, ghat0[j0:j0 + k])     # ĝ is only read
    want_m = m0.clone()
    want_m[:] = 0.0 if kz < 0 else m0
    if kz >= 0:
        want_m[old] = 0.0
    want_m[sl] = mn
    assert torch.equal(m, want_m)
    new_theta = decayed.clone()
    new_theta[sl] += upd
    if sharded:
        torch.testing.assert_close(got[nt + 2], new_theta[sl], rtol=1e-6, atol=1e-9)
        assert torch.equal(torch.cat(theta), torch.cat(theta0))    # θ itself not written
    else:
        torch.testing.assert_close(torch.cat(theta), new_theta, rtol=1e-6, atol=1e-9)
        off_mask = torch.ones(N, dtype=torch.bool)
        off_mask[sl] = False
        off_mask[torch.cat([torch.arange(o, o + n) for o, n, a, b in rows
                            if not (max(a, j0) < min(b, j0 + k))] or [torch.arange(0)])] = False
        # off the mask the decay alone, bit for bit (a tensor outside the slice: untouched)
        assert torch.equal(torch.cat(theta)[off_mask], decayed[off_mask])
    scattered = torch.cat(got[-nt:])
    want = decayed.clone()
    want[idx] = torch.randn(K, generator=torch.Generator().manual_seed(16))
    assert torch.equal(scattered, want)


def test_replicated_prepare_fix_up_is_the_same_on_any_number_of_threads():
    """The prepare with m's support known: the full pass and the fix-up at pidx (k-sized, on
    threads too), e and Σ c² bit for bit."""
    g = torch.Generator().manual_seed(17)
    sizes = [b - a for a, b in zip([0] + CUTS, CUTS + [N])]
    offs = [0] + CUTS
    grads = [torch.randn(s, generator=g) for s in sizes]
    gtab = native.table([[x.data_ptr(), o] for x, o in zip(grads, offs)], 2)
    numels = torch.tensor(sizes, dtype=torch.int64)
    pidx = _index_list(18)
    rows = _segments(pidx, CUTS)
    ptab = native.table([[x.data_ptr(), off, a, b] for x, (off, _, a, b) in zip(grads, rows)
                         if a < b], 4)
    e0 = torch.randn(N, generator=g)
    e0[pidx] = 0.0
    m = torch.randn(N, generator=g)

    def run():
        e = e0.clone()
        sq = LIB.scape_prepare_replicated(len(sizes), native.ptr(gtab), native.ptr(numels),
                                          native.ptr(e), native.ptr(m), native.ptr(pidx),
                                          pidx.numel(), native.ptr(ptab), ptab.shape[0], 0.9,
                                          0.1)
        return e, sq

    e, sq = _same_on_every_count(run)
    flat_g = torch.cat(grads)
    want = e0 + flat_g * 0.1
    want[pidx] = m[pidx] * 0.9 + flat_g[pidx] * 0.1
    assert torch.equal(e, want)
    assert sq == pytest.approx(float(want.double().square().sum()), rel=1e-12)


def test_prepare_with_the_payload_gather_is_the_same_on_any_number_of_threads():
    """The prepare, the payload gather and m's in one walk of one flat gradient: e, m, the
    payload, the old m at M_t and Σ c² off M_t bit for bit on any thread count, and equal to
    the separate passes' torch ops."""
    g = torch.Generator().manual_seed(19)
    grad, m = torch.randn(N, generator=g), torch.randn(N, generator=g)
    pidx, idx = _index_list(20), _index_list(21, k=K - 4_321)     # M_{t-1}'s, M_t's
    e0 = torch.randn(N, generator=g)
    e0[pidx] = 7.0            # stale (the deferred fold): overwritten, never read

    m[torch.randperm(N, generator=g)[:N // 2]] = 0.0    # m is nonzero on its support only:
    m[pidx] = torch.randn(pidx.numel(), generator=g)     # here on more, to see what is zeroed

    def run():
        e, mm = e0.clone(), m.clone()
        payload, mc = torch.empty(idx.numel()), torch.empty(idx.numel())
        sq = LIB.scape_prepare_gather(N, native.ptr(grad), native.ptr(e), native.ptr(mm),
                                      native.ptr(pidx), pidx.numel(), native.ptr(idx),
                                      idx.numel(), native.ptr(payload), native.ptr(mc), 0.9,
                                      0.1)
        return e, mm, payload, mc, sq

    e, mm, payload, mc, sq = _same_on_every_count(run)
    want = e0 + grad * 0.1
    want[pidx] = m[pidx] * 0.9 + grad[pidx] * 0.1
    assert torch.equal(e, want)
    assert torch.equal(payload, want[idx])
    assert torch.equal(mc, m[idx])                 # the old momentum at M_t
    want_m = m.clone()
    want_m[pidx] = 0.0                             # and zeroed on its old support
    assert torch.equal(mm, want_m)
    off = torch.ones(N, dtype=torch.bool)
    off[idx] = False
    assert sq == pytest.approx(float(want[off].double().square().sum()), rel=1e-12)


def test_sharded_prepare_with_the_payload_rows_is_the_same_on_any_number_of_threads():
    """The sharded prepare's walk (rank 1 of 3, its range off the blocks' bounds): ε, ρ, m, the
    candidate, the reduce-scatter's rows, the owner's m and ρ at M_t and Σ ε² bit for bit on any
    thread count, and equal to the separate passes' torch ops."""
    g = torch.Generator().manual_seed(23)
    lo, hi = 300_007, 900_011
    grad, x0, m0 = (torch.randn(N, generator=g) for _ in range(3))
    rho0 = torch.randn(hi - lo, generator=g)
    m0[:lo] = 0.0
    m0[hi:] = 0.0                      # m lives on the own range
    idx = _index_list(24)
    pidx = torch.sort(torch.randperm(hi - lo, generator=g)[:K // 3]).values   # own-range
    bounds = [0, lo, hi, N]
    counts = [int(((idx >= a) & (idx < b)).sum()) for a, b in zip(bounds, bounds[1:])]
    starts = [0, counts[0], counts[0] + counts[1]]
    width = max(counts)
    rows = native.table([[starts[r], r * width - starts[r]] for r in range(3)], 2)
    a, b = starts[1], starts[1] + counts[1]

    def run():
        x, rho, m = x0.clone(), rho0.clone(), m0[lo:hi].clone()
        cand, send = torch.empty(hi - lo), torch.zeros(3, width)
        mc, rho_at = torch.empty(b - a), torch.empty(b - a)
        sq = LIB.scape_prepare_take(N, native.ptr(grad), native.ptr(x), native.ptr(rho),
                                    native.ptr(m), native.ptr(pidx), pidx.numel(), lo, hi,
                                    native.ptr(cand), native.ptr(idx), idx.numel(),
                                    native.ptr(rows), 3, native.ptr(send), a, b,
                                    native.ptr(mc), native.ptr(rho_at), 0.9, 0.1)
        return x, rho, m, cand, send, mc, rho_at, sq

    x, rho, m, cand, send, mc, rho_at, sq = _same_on_every_count(run)
    m_own = m0[lo:hi]
    want_rho = rho0.clone()
    want_rho[pidx] = m_own[pidx] * 0.9
    want_x = x0 + grad * 0.1
    assert torch.equal(cand, want_rho + want_x[lo:hi])
    own = idx[a:b] - lo
    assert torch.equal(mc, m_own[own]) and torch.equal(rho_at, want_rho[own])
    want_rho[own] = 0.0
    assert torch.equal(rho, want_rho)
    want_m = m_own.clone()
    want_m[pidx] = 0.0
    assert torch.equal(m, want_m)
    for r in range(3):
        assert torch.equal(send[r, :counts[r]], want_x[idx[starts[r]:starts[r] + counts[r]]])
        assert not send[r, counts[r]:].any()
    want_x[idx] = 0.0
    assert torch.equal(x, want_x)
    assert sq == pytest.approx(float(want_x.double().square().sum()), rel=1e-12)


def test_traffic_takes_each_loops_arguments():
    """``native._TRAFFIC`` counts bytes from the arguments by position: each entry takes the
    arguments a caller passes (the loop's list less the thread count, which the wrapper adds)."""
    for name, (_, args) in native._SIGNATURES.items():
        inspect.signature(native._TRAFFIC[name]).bind(*range(len(args) - 1))


# -- the mask codings --------------------------------------------------------------------------

def _big_layout():
    from torch import nn

    from scape_train.optim.scape.partition import ParamLayout

    torch.manual_seed(0)
    layers = [nn.Linear(701, 1201), nn.LayerNorm(1201)]
    layers += [nn.Linear(1201, 1201, bias=i % 2 == 0) for i in range(3)]
    layers += [nn.Linear(1201, 333)]
    return ParamLayout(nn.Sequential(*layers), weight_decay=0.1, exclude_norm_bias=True)


@pytest.mark.parametrize("world,partitioner", [(1, "tensor"), (3, "flat")])
@pytest.mark.parametrize("coding", ["auto", "indices", "elias_fano"])
def test_encode_and_decode_are_the_same_on_any_number_of_threads(world, partitioner, coding,
                                                                  monkeypatch):
    """Segments encode and decode on threads (at least 5 parts' worth of ones here: 1.5M)."""
    from scape_train.optim.scape.mask_coding import MaskPlan
    from scape_train.optim.scape.masks import mask_counts, topk_own_mask
    from scape_train.optim.scape.partition import build_partition

    lay = _big_layout()
    assert lay.total * 0.3 > 5 * MIN_PER_THREAD
    part = build_partition(lay, world, partitioner)
    plan = MaskPlan(part, lay, mask_counts(part, lay, 0.3), coding, lay.total)
    stat = torch.randn(lay.total, generator=torch.Generator().manual_seed(1))
    bits = [topk_own_mask(stat[lo:hi], part, r, lay, 0.3) for r, (lo, hi) in
            enumerate(part.ranges)]
    cpu = torch.device("cpu")
    coded = [(r, sc) for r, codes in enumerate(plan.segs) for sc in codes if sc.kind != "all"]
    broken = [coded[len(coded) // 3], coded[2 * len(coded) // 3]]

    def run():
        shards = [plan.encode(b, r) for r, b in enumerate(bits)]
        gathered = torch.cat(shards)
        mask, idx = plan.decode_with_indices(gathered, cpu)
        bad = gathered.clone()
        for r, sc in broken:          # two segments surely broken: the lower one is named
            at = r * plan.shard_bytes + sc.off
            if sc.kind == "indices":               # fields out of order
                bad[at:at + sc.low_bytes] = 0xFF
            else:                                  # no ones in the bitmap / upper bits
                bad[at + sc.low_bytes:at + sc.low_bytes + sc.high_bytes] = 0
        try:
            plan.decode_with_indices(bad, cpu)
            err = None
        except RuntimeError as exc:
            err = str(exc)
        return gathered, mask.clone(), idx.clone(), err

    gathered, mask, idx, err = _same_on_every_count(run)
    assert err is not None and f"(segment at flat {broken[0][1].flat_start})" in err, err
    monkeypatch.setenv("SCAPE_NATIVE", "0")        # the torch path's bytes and mask
    assert torch.equal(gathered, torch.cat([plan.encode(b, r) for r, b in enumerate(bits)]))
    mask_t, _ = plan.decode_with_indices(gathered, cpu)
    assert torch.equal(mask, mask_t) and torch.equal(idx, torch.nonzero(mask_t).view(-1))
