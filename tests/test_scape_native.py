"""SCAPE's C loops (``optim/scape/native``) against the torch path they stand in for on the CPU.

The codings are lossless, so the C encode and decode must give the torch path's bytes, mask and
indices exactly; the C top-k must select exactly torch.topk's set; the C fused step must match
the torch fused step (the path CUDA runs) and the reference engine to the tolerance of
tests/test_scape_fused.py; bad bytes must give an error, never a write out of bounds; and a
machine with no compiler must still train (the torch path, with one warning).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from scape_train.optim.scape import kernels, native
from scape_train.optim.scape.mask_coding import MaskPlan
from scape_train.optim.scape.masks import _top_k_bits_native, mask_counts, topk_own_mask
from scape_train.optim.scape.partition import ParamLayout, build_partition

from ._optim_common import make, train_step
from .test_scape_fused import _cfg, _compare, _pair_run

LIB = native.lib(torch.zeros(1))
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler: the torch path runs")


@pytest.fixture
def torch_path(monkeypatch):
    """Run a block on the torch path (what SCAPE_NATIVE=0 selects)."""
    def use(flag: bool):
        monkeypatch.setenv("SCAPE_NATIVE", "0" if flag else "1")
    return use


def _layout() -> ParamLayout:
    # odd sizes: segments that end mid-byte, a norm (excluded: all ones), uneven ranges
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(301, 517), nn.LayerNorm(517), nn.Linear(517, 33),
                          nn.Linear(33, 7, bias=False))
    return ParamLayout(model, weight_decay=0.1, exclude_norm_bias=True)


@pytest.mark.parametrize("world,partitioner", [(1, "tensor"), (3, "flat"), (4, "tensor")])
@pytest.mark.parametrize("coding", ["auto", "indices", "elias_fano"])
@pytest.mark.parametrize("density", [0.003, 0.05, 0.3])
def test_encode_and_decode_equal_the_torch_path(world, partitioner, coding, density,
                                                torch_path):
    lay = _layout()
    part = build_partition(lay, world, partitioner)
    plan = MaskPlan(part, lay, mask_counts(part, lay, density), coding, lay.total)
    stat = torch.randn(lay.total, generator=torch.Generator().manual_seed(1))
    shards = []
    for r, (lo, hi) in enumerate(part.ranges):
        bits = topk_own_mask(stat[lo:hi], part, r, lay, density)
        torch_path(True)
        want = plan.encode(bits, r)
        torch_path(False)
        got = plan.encode(bits, r)
        assert torch.equal(got, want), r
        shards.append(got)
    gathered = torch.cat(shards) if plan.shard_bytes else None
    mask, idx = plan.decode_with_indices(gathered, torch.device("cpu"))
    torch_path(True)
    mask_t, idx_t = plan.decode_with_indices(gathered, torch.device("cpu"))
    assert torch.equal(mask, mask_t)
    assert torch.equal(idx, torch.nonzero(mask_t).view(-1))
    if idx_t is not None:
        assert torch.equal(idx, idx_t)
    assert set(plan.kinds()) <= {"all", "bitmap", "indices", "elias_fano"}
    # what the step asks for: the indices alone, no bool mask written (C; torch for EF)
    none_t, lean_t = plan.decode_with_indices(gathered, torch.device("cpu"), with_mask=False)
    assert (none_t is None) == (idx_t is not None)
    if idx_t is not None:
        assert torch.equal(lean_t, idx_t)
    torch_path(False)
    none, lean = plan.decode_with_indices(gathered, torch.device("cpu"), with_mask=False)
    assert none is None and torch.equal(lean, idx)
    none, lean, bits = plan.decode_parts(gathered, torch.device("cpu"))   # and the packed mask
    packed = kernels.pack_bits(mask, backend="torch")
    assert none is None and torch.equal(bits[:packed.numel()], packed)
    assert not bits[packed.numel():].any()


def _ef_plan_and_bytes():
    lay = _layout()
    part = build_partition(lay, 2, "flat")
    plan = MaskPlan(part, lay, mask_counts(part, lay, 0.02), "elias_fano", lay.total)
    stat = torch.randn(lay.total, generator=torch.Generator().manual_seed(2))
    shards = [plan.encode(topk_own_mask(stat[lo:hi], part, r, lay, 0.02), r)
              for r, (lo, hi) in enumerate(part.ranges)]
    return plan, torch.cat(shards), part, lay


def test_corrupt_bytes_give_an_error_not_a_wild_write():
    plan, gathered, _, _ = _ef_plan_and_bytes()
    rng = torch.Generator().manual_seed(3)
    errors = 0
    for trial in range(40):
        bad = gathered.clone()
        pos = torch.randint(bad.numel(), (4,), generator=rng)
        bad[pos] = torch.randint(256, (4,), generator=rng, dtype=torch.uint8)
        try:
            mask, idx = plan.decode_with_indices(bad, torch.device("cpu"))
        except RuntimeError as exc:
            assert "do not match the plan" in str(exc)
            errors += 1
            continue
        # bytes that still decode (a low field changed within order) decode consistently
        assert idx.numel() == int(mask.sum()) and torch.equal(idx, torch.nonzero(mask).view(-1))
    assert errors > 0
    with pytest.raises(RuntimeError, match="do not match the plan"):
        plan.decode_with_indices(gathered[:plan.shard_bytes], torch.device("cpu"))  # 1 of 2


def test_encode_refuses_bits_that_break_the_plan():
    plan, _, part, lay = _ef_plan_and_bytes()
    lo, hi = part.ranges[0]
    bits = torch.zeros(hi - lo, dtype=torch.bool)    # no ones where the plan expects k
    with pytest.raises(RuntimeError, match="does not hold"):
        plan.encode(bits, 0)


@pytest.mark.parametrize("n,k", [(100_003, 1000), (1 << 20, 10_000), (5000, 600),
                                 (40_000, 4_999)])
@pytest.mark.parametrize("dist", ["normal", "ties", "outlier"])
def test_top_k_bits_are_torch_topk_set(n, k, dist):
    g = torch.Generator().manual_seed(n + k)
    c = torch.randn(n, generator=g)
    if dist == "ties":
        c = torch.round(c * 4) / 4                     # many entries equal to the k-th value
    if dist == "outlier":
        c[: n // 10] *= 100                            # the sample sees a skewed segment
    bits = torch.zeros(n, dtype=torch.bool)
    assert _top_k_bits_native(LIB, c, k, bits)
    assert int(bits.sum()) == k
    want = torch.topk(c.abs(), k).values
    assert torch.equal(torch.sort(c.abs()[bits]).values, torch.sort(want).values)


def test_top_k_bits_decline_what_they_cannot_do():
    c = torch.randn(50_000)
    bits = torch.zeros(50_000, dtype=torch.bool)
    assert not _top_k_bits_native(LIB, c, 10, bits)          # sparse pick: torch's small topk
    c[7] = float("nan")
    assert not _top_k_bits_native(LIB, c, 1000, bits)        # NaN: torch.topk decides
    assert not bits.any()


@pytest.mark.parametrize("sharded", [False, True])
def test_c_step_equals_the_torch_fused_step(sharded, torch_path):
    """The same runs with the C loops and with the torch ops CUDA runs (SCAPE_NATIVE=0)."""
    torch_path(True)
    want = _pair_run(0, sharded=sharded)
    torch_path(False)
    got = _pair_run(0, sharded=sharded)
    for a, b in zip(want, got):
        for key in ("mask", "next"):
            assert torch.equal(a[key][1], b[key][1]), key
    _compare([dict(p=(a["p"][1], b["p"][1]), state={k: (v[1], b["state"][k][1])
                                                    for k, v in a["state"].items()},
                   mask=a["mask"], next=a["next"], metrics=(a["metrics"][1], b["metrics"][1]))
              for a, b in zip(want, got)])


def test_static_path_without_host_reads_still_equals_the_reference(monkeypatch):
    """With host reads off (what the NCCL-rule tests and the plan's trace run) neither the C
    loops nor the CPU's data-dependent ops run: the torch fused path, against the reference."""
    monkeypatch.setattr(kernels, "HOST_READS_ON_CPU", False)
    assert native.lib(torch.zeros(1)) is None
    _compare(_pair_run(0, sharded=True))


def test_no_compiler_warns_once_and_trains_on_the_torch_path(tmp_path):
    code = (
        "import warnings, torch\n"
        "from scape_train.optim.scape import native\n"
        "from tests.test_scape_fused import _pair_run\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert native.lib(torch.zeros(1)) is None\n"
        "    assert native.lib(torch.zeros(1)) is None\n"
        "    runs = _pair_run(0, steps=3)\n"
        "msgs = [str(x.message) for x in w if 'C loops' in str(x.message)]\n"
        "assert len(msgs) == 1 and 'torch path runs instead' in msgs[0], msgs\n"
        "assert all(torch.equal(*r['mask']) for r in runs)\n"
        "print('ok')\n")
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/cc",
           "SCAPE_NATIVE_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=str(Path(__file__).resolve().parents[1]),
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_device_op_counter_counts_the_c_loops_bytes():
    """Benchmarks report bytes per parameter from DeviceOpCounter: the C loops, which dispatch
    no torch op, count what they touch (here a gather of k positions: index, value, write)."""
    from scape_train.profiling import DeviceOpCounter

    src = torch.zeros(1000)
    idx = torch.arange(0, 1000, 7)
    out = torch.empty(idx.numel())
    with DeviceOpCounter() as ops:
        LIB.scape_gather(idx.numel(), native.ptr(idx), 0, native.ptr(src), native.ptr(out))
    assert ops.ops["native::scape_gather"] == 1 and ops.bytes_moved == 16 * idx.numel()
    s, w, _ = make(_cfg(density_warmup_steps=0))
    train_step(s, w, 1, 0)
    with DeviceOpCounter() as ops:
        train_step(s, w, 2, 0)
    # one flat gradient and M_t's decoded indices: the prepare gathers the payload on its way
    assert {"native::scape_adams", "native::scape_mask_decode",
            "native::scape_prepare_gather"} <= set(ops.ops)
    assert "native::scape_gather" not in ops.ops
    assert not native.counters           # the counter unregisters itself


def test_decode_reuses_only_buffers_nothing_holds():
    """The C decode's index vectors come from a pool of two; one still referenced (by a name or
    a view) is never handed out again. Without ``with_mask`` no bool mask is written."""
    plan, gathered, _, _ = _ef_plan_and_bytes()
    cpu = torch.device("cpu")
    m1, i1 = plan.decode_with_indices(gathered, cpu, with_mask=False)
    m2, i2 = plan.decode_with_indices(gathered, cpu, with_mask=False)   # i1 is held: a new one
    assert m1 is None and m2 is None and i1.data_ptr() != i2.data_ptr()
    view = i1[3:]                                              # a view holds i1's storage
    ptr1 = i1.data_ptr()
    del i1
    _, i3 = plan.decode_with_indices(gathered, cpu, with_mask=False)
    assert i3.data_ptr() != ptr1
    del view, i3
    _, i4 = plan.decode_with_indices(gathered, cpu, with_mask=False)   # now a pooled one is free
    assert i4.data_ptr() == ptr1 and i4.data_ptr() in {g[0].data_ptr()
                                                       for g in plan._pool._groups}
    assert torch.equal(i4, i2)
    mask, i5 = plan.decode_with_indices(gathered, cpu)         # with the mask: the same ones
    assert torch.equal(i5, i2) and torch.equal(torch.nonzero(mask).view(-1), i2)


@pytest.mark.parametrize("kind", ["add", "general", "cand"])
def test_full_size_prepares_are_the_same_on_any_number_of_threads(kind):
    """The prepare's full pass splits the flat space over torch's thread count: e (and the
    sharded candidate) and the square sum (by blocks of 2^16, added in block order) bit for bit
    whatever the split. Tensors of odd sizes so that thread ranges start and end inside tensors
    and inside the own range."""
    gen = torch.Generator().manual_seed(3)
    sizes = [300_001, 7, 650_003, 1, 420_000]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    grads = [torch.randn(n, generator=gen) for n in sizes]
    gtab = native.table([[g.data_ptr(), o] for g, o in zip(grads, offs)], 2)
    numels = torch.tensor(sizes, dtype=torch.int64)
    e0, m = torch.randn(total, generator=gen), torch.randn(total, generator=gen)
    lo, hi = 123_457, 1_001_001                     # an own range crossing three tensors
    runs = []
    saved = torch.get_num_threads()
    for nthreads in (1, 2, 3, 5):
        torch.set_num_threads(nthreads)        # the C loops run on torch's count
        e = e0.clone()
        cand = torch.full((hi - lo,), float("nan"))
        rho = m[lo:hi].clone()
        if kind == "general":
            sq = LIB.scape_prepare_replicated_general(len(sizes), native.ptr(gtab),
                                                      native.ptr(numels), native.ptr(e),
                                                      native.ptr(m), 0.9, 0.1)
        elif kind == "add":
            sq = LIB.scape_prepare_replicated(len(sizes), native.ptr(gtab), native.ptr(numels),
                                              native.ptr(e), native.ptr(m), None, 0, None, 0,
                                              0.9, 0.1)
        else:
            sq = LIB.scape_prepare_sharded(len(sizes), native.ptr(gtab), native.ptr(numels),
                                           native.ptr(e), native.ptr(rho), native.ptr(m), None,
                                           0, lo, hi, native.ptr(cand), 0.9, 0.1)
        runs.append((e, cand, sq))
    torch.set_num_threads(saved)
    g = torch.cat(grads)
    want = (m * 0.9 + g * 0.1) + e0 if kind == "general" else e0 + g * 0.1
    for e, cand, sq in runs:
        assert torch.equal(e, want)
        assert sq == runs[0][2]
        assert sq == pytest.approx(float(want.double().square().sum()), rel=1e-12)
        if kind == "cand":
            assert torch.equal(cand, m[lo:hi] + want[lo:hi])
