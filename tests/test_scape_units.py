"""SCAPE pieces in one process: partitions, density, masks, config validation, bad inputs, and
the one-worker cases (n = 1: d = 1 equals AdamS; the §2 invariants still hold for d < 1)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from scape_train.optim import build_optimizer
from scape_train.comm import Comm
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.density import density_at, segment_k
from scape_train.optim.scape.kernels import pack_bits
from scape_train.optim.scape.strategy import select_passes
from scape_train.optim.scape.torch_passes import TorchPasses
from scape_train.optim.scape.mask_format import bits_bytes
from scape_train.optim.scape.masks import Mask, MaskExchange, overlap, topk_own_mask
from scape_train.optim.scape.partition import ParamLayout, build_partition

from ._optim_common import flat_params, make, tiny_model, train_step
from ._scape_checks import check_invariants, record_run


def layout_of(model, exclude=True):
    return ParamLayout(model, weight_decay=0.1, exclude_norm_bias=exclude)


@pytest.mark.parametrize("kind", ["tensor", "flat"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_partition_covers_every_element_once(kind, world):
    lay = layout_of(tiny_model())
    part = build_partition(lay, world, kind)
    owner = torch.full((lay.total,), -1)
    for r, ((lo, hi), segs) in enumerate(zip(part.ranges, part.segments)):
        assert sum(s.numel for s in segs) == hi - lo
        for s in segs:
            assert 0 <= s.start < s.end <= lay.numels[s.tensor]
            assert s.flat_start == lay.offsets[s.tensor] + s.start
            assert torch.all(owner[s.flat_start:s.flat_start + s.numel] == -1)
            owner[s.flat_start:s.flat_start + s.numel] = r
    assert torch.all(owner >= 0)
    assert torch.all(owner[1:] >= owner[:-1])        # contiguous, in rank order
    if kind == "tensor":   # whole tensors only
        for segs in part.segments:
            assert all(s.start == 0 and s.end == lay.numels[s.tensor] for s in segs)
    else:                  # equal chunks, the last one short
        chunk = -(-lay.total // world)
        assert all(hi - lo == chunk for lo, hi in part.ranges[:-1] if hi < lay.total)


def test_tensor_partition_is_balanced():
    model = nn.Sequential(*[nn.Linear(10, 10, bias=False) for _ in range(8)])
    part = build_partition(layout_of(model), 4, "tensor")
    assert [hi - lo for lo, hi in part.ranges] == [200] * 4


def test_density_schedule():
    assert density_at(0, 0.01, 100) == 1.0
    assert density_at(50, 0.01, 100) == pytest.approx(0.1)
    assert density_at(100, 0.01, 100) == 0.01
    assert density_at(5000, 0.01, 100) == 0.01
    assert density_at(3, 0.1, 100, "constant") == 0.1
    assert density_at(3, 0.1, 0) == 0.1
    assert segment_k(1000, 0.01) == 10 and segment_k(50, 0.01) == 1 and segment_k(7, 1.0) == 7
    with pytest.raises(ValueError):
        density_at(1, 0.0, 10)


def test_topk_mask_exact_k_and_excluded_ones():
    lay = layout_of(tiny_model())
    part = build_partition(lay, 1, "flat")
    stat = torch.randn(lay.total)
    bits = topk_own_mask(stat, part, 0, lay, 0.1)
    for i, n in enumerate(lay.numels):
        piece = bits[lay.offsets[i]:lay.offsets[i + 1]]
        if lay.excluded[i]:
            assert piece.all()
        else:
            assert int(piece.sum()) == segment_k(n, 0.1)
            chosen = stat[lay.offsets[i]:lay.offsets[i + 1]].abs()[piece]
            assert chosen.min() >= stat[lay.offsets[i]:lay.offsets[i + 1]].abs()[~piece].max()


def test_mask_exchange_round_trip_one_process():
    lay = layout_of(tiny_model())
    part = build_partition(lay, 1, "flat")
    ex = MaskExchange(part, Comm(), lay.total, TorchPasses())
    bits = torch.rand(lay.total) < 0.3
    assert torch.equal(ex.start(bits).wait(), bits)


@pytest.mark.parametrize("variant", ["adam", "official", "none"])
def test_one_worker_density_one_equals_adams(variant):
    kw = dict(lr=1e-2, clip_grad=0.05, bias_correction=variant, density=1.0)
    scape, w_s, _ = make(OptimizerConfig(name="scape", **kw))
    dense, w_d, _ = make(OptimizerConfig(name="adams", **kw))
    clipped = False
    for t in range(1, 6):
        ms = train_step(scape, w_s, t, 0)
        md = train_step(dense, w_d, t, 0)
        clipped |= md["grad_norm"] > 0.05
        torch.testing.assert_close(flat_params(w_s), flat_params(w_d), rtol=1e-6, atol=1e-6)
        assert ms["grad_norm"] == pytest.approx(md["grad_norm"], rel=1e-5)
        assert ms["scape/density"] == 1.0 and ms["scape/residual_norm"] == 0.0
    assert clipped


@pytest.mark.parametrize("partitioner", ["tensor", "flat"])
def test_one_worker_invariants_sparse(partitioner):
    cfg = OptimizerConfig(name="scape", lr=1e-2, density=0.15, density_schedule="geometric",
                          density_warmup_steps=2, partitioner=partitioner, clip_grad=0.0)
    strategy, wrapped, _ = make(cfg)
    check_invariants([record_run(strategy, wrapped, 0, steps=4)], clip_active=False)


def test_offload_equals_device_residual_one_worker():
    # offloaded residuals run on the reference engine: compared with it, bit for bit
    cfg = dict(name="scape", lr=1e-2, density=0.2, density_schedule="constant",
               scape_impl="reference")
    a, wa, _ = make(OptimizerConfig(**cfg))
    b, wb, _ = make(OptimizerConfig(**cfg, offload_residuals=True, offload_chunk_numel=50))
    for t in range(1, 5):
        train_step(a, wa, t, 0)
        train_step(b, wb, t, 0)
    assert torch.equal(flat_params(wa), flat_params(wb))
    assert torch.equal(a.reference.state.residual.full(), b.reference.state.residual.full())


def test_state_dict_loads_with_weights_only_and_is_per_parameter():
    strategy, wrapped, model = make(OptimizerConfig(name="scape", density=0.3,
                                                    density_schedule="constant"))
    for t in range(1, 3):
        train_step(strategy, wrapped, t, 0)
    state = strategy.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    names = [n for n, _ in model.named_parameters()]
    for key in ("momentum", "residual", "mask_cur", "mask_next"):
        assert list(loaded[key]) == names
    for n, p in model.named_parameters():
        assert loaded["momentum"][n].shape == p.shape
        assert loaded["mask_next"][n].dtype == torch.uint8
        assert loaded["mask_next"][n].numel() == (p.numel() + 7) // 8
    assert loaded["step"] == 2


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,words", [
    ("name", "sgd", "valid names"), ("density", 0.0, "density"), ("density", 1.5, "density"),
    ("partitioner", "rows", "partitioner"), ("bias_correction", "x", "bias_correction"),
    ("betas", [0.9, 1.0], "betas"), ("density_schedule", "cosine", "density_schedule"),
    ("weight_decay", -1.0, "weight_decay"), ("clip_grad", -1.0, "clip_grad"),
    ("use_triton", "maybe", "use_triton"), ("offload_chunk_numel", 0, "offload_chunk_numel"),
    ("powersgd_start_iter", 1, "powersgd_start_iter"),
])
def test_bad_config_is_a_clear_error(field, value, words):
    cfg = OptimizerConfig(name="scape")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=words):
        build_optimizer(cfg, tiny_model())


def test_missing_gradient_names_the_parameter():
    model = tiny_model()
    strategy = build_optimizer(OptimizerConfig(name="scape"), model)
    model[0](torch.randn(2, 12)).sum().backward()      # the layers after the first get none
    with pytest.raises(RuntimeError, match=r"'1\.weight' has no gradient"):
        strategy.step(1e-3)


def test_non_fp32_parameters_are_rejected():
    with pytest.raises(TypeError, match="fp32"):
        build_optimizer(OptimizerConfig(name="scape"), tiny_model().to(torch.bfloat16))


def test_triton_kernels_path_equals_torch_path():
    """use_triton=on runs the Triton kernels (interpreted on CPU here): the same masks, the
    same parameters to the fused step's tolerance (tests/test_scape_fused.py)."""
    kw = dict(name="scape", lr=1e-2, density=0.2, density_schedule="constant")
    a, wa, _ = make(OptimizerConfig(**kw, use_triton="off"))
    b, wb, _ = make(OptimizerConfig(**kw, use_triton="on"))
    for t in range(1, 4):
        train_step(a, wa, t, 0)
        train_step(b, wb, t, 0)
    pa, pb = flat_params(wa), flat_params(wb)
    torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-6 * float(pa.abs().max()))
    assert torch.equal(a.mask_cur, b.mask_cur)


# -- the step's mask: indices, its bool form on demand, the overlap metric ----------------------

def test_a_mask_of_indices_makes_its_bool_form_on_demand():
    idx = torch.tensor([0, 3, 4, 9, 10], dtype=torch.int64)
    want = torch.zeros(11, dtype=torch.bool)
    want[idx] = True
    m = Mask(11, indices=idx)
    assert torch.equal(m.dense(keep=False), want) and m._dense is None   # not kept
    bits = m.dense()
    assert torch.equal(bits, want) and m.dense() is bits                 # kept until keep_one_form()
    m.keep_one_form()                             # 5 ones of 11: the indices (40 B) > the bools (11 B)
    assert m.indices is None and m.dense() is bits
    assert torch.equal(m.index(5), idx)    # made again from the bool tensor
    sparse = Mask(100, indices=idx)
    sparse.dense()
    sparse.keep_one_form()                        # 5 of 100: the indices are the smaller
    assert sparse._dense is None and sparse.indices is idx
    held = Mask.of(want)                   # a bool mask (the legacy coding, a checkpoint)
    assert Mask.of(held) is held and Mask.of(None) is None
    assert torch.equal(held.index(5), idx)
    held.keep_one_form()           # indices made from it (the fused step holds them): they stay
    assert held._dense is None and torch.equal(held.indices, idx)
    assert torch.equal(held.dense(), want)                              # made again on demand
    unread = Mask.of(want)
    unread.keep_one_form()                        # nothing was made: the bool tensor as it is
    assert unread.dense() is want and unread.indices is None
    with pytest.raises(ValueError, match="bool tensor or its indices"):
        Mask(11)
    with pytest.raises(ValueError, match="11 elements"):
        Mask(11, dense=torch.zeros(12, dtype=torch.bool))
    with pytest.raises(ValueError, match="come with its indices"):
        Mask(11, dense=want, bits=torch.zeros(16, dtype=torch.uint8))


@pytest.mark.parametrize("path", ["off", "on"])
def test_overlap_from_the_index_lists_equals_the_full_size_and(path):
    """The masks' overlap metric from the two sorted index lists (Triton: marked bits and
    lookups; torch: a bool map) equals the count of the bool masks' AND, including empty,
    disjoint and identical lists and lengths that end mid-block."""
    if path == "on":
        pytest.importorskip("triton")
    n = 50_021
    g = torch.Generator().manual_seed(5)
    base = torch.sort(torch.randperm(n, generator=g)[:3001]).values

    def mask_of(idx):
        return Mask(n, indices=idx)

    cases = [(base, torch.sort(torch.randperm(n, generator=g)[:2500]).values),
             (base, base.clone()), (base, base[1::2].clone()),
             (base, torch.zeros(0, dtype=torch.int64)), (base[:0], base),
             (base[::3].clone(), torch.arange(n - 1, dtype=torch.int64)),
             (torch.tensor([n - 1]), torch.tensor([0, n - 1]))]
    lib = select_passes(path, torch.device("cpu"))
    for a, b in cases:
        want = int((mask_of(a).dense() & mask_of(b).dense()).sum())
        got = overlap(mask_of(a), mask_of(b), lib)
        assert isinstance(got, torch.Tensor) and int(got) == want, (a.numel(), b.numel())
    # the previous mask's packed bits from its decode: the lookups alone
    for a, b in cases:
        if not b.numel():
            continue
        bits = torch.zeros(bits_bytes(n), dtype=torch.uint8)
        packed = pack_bits(mask_of(b).dense())
        bits[:packed.numel()] = packed
        want = int((mask_of(a).dense() & mask_of(b).dense()).sum())
        assert int(overlap(mask_of(a), Mask(n, indices=b, bits=bits), lib)) == want
    # one side held only as a bool mask: the full-size AND
    a, b = cases[0]
    assert int(overlap(mask_of(a), Mask.of(mask_of(b).dense()), lib)) == int(
        (mask_of(a).dense() & mask_of(b).dense()).sum())
