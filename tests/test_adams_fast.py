"""AdamS's multi-tensor paths (``foreach``, ``triton`` under ``TRITON_INTERPRET=1``, see
tests/conftest.py) against the per-tensor reference (:func:`adams_update_`), and the dense
strategy's choice of AdamS / AdamW implementation."""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.adams import AdamS, select_update
from scape_train.optim.adams_constants import AdamSConstants
from scape_train.optim.adams_foreach import chunked_update, foreach_update
from scape_train.optim.adams import reference_update
from scape_train.profiling import DeviceOpCounter

# mixed shapes: whole blocks only, tails only, both, a scalar-sized one (the tests' block is 256)
SHAPES = [(16, 32), (300,), (7, 130), (1,), (512,), (3, 5, 17)]
BLOCK = 256


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _run(impl, dtype, steps, *, wd, bias, clip=None, seed=0):
    """Params and momenta after ``steps`` steps of AdamS with ``impl`` on a fixed gradient stream
    (decay on the matrices only, as the trainer groups them)."""
    params = _params(dtype, seed)
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": wd},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    opt = AdamS(groups, lr=3e-3, bias_correction=bias, impl=impl)
    if impl == "triton":
        opt.update.block = BLOCK       # the interpreter's cost is per program
    gen = torch.Generator().manual_seed(seed + 1)
    for t in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        coef = None if clip is None else torch.tensor(clip / (t + 1), dtype=torch.float32)
        opt.step(grad_coef=coef)
    return [p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params]


@pytest.mark.parametrize("impl", ["foreach", "triton"])
@pytest.mark.parametrize("bias", ["adam", "official", "none"])
@pytest.mark.parametrize("wd,clip", [(0.1, None), (0.0, None), (0.1, 0.7)])
def test_fast_paths_equal_the_reference(impl, bias, wd, clip):
    ref = _run("reference", torch.float32, 5, wd=wd, bias=bias, clip=clip)
    got = _run(impl, torch.float32, 5, wd=wd, bias=bias, clip=clip)
    for r, g in zip(ref[0] + ref[1], got[0] + got[1]):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    if impl == "foreach":      # the same ATen kernels in the same order: the same bits
        assert all(torch.equal(r, g) for r, g in zip(ref[0] + ref[1], got[0] + got[1]))


def test_triton_bf16_rounds_once_from_fp32_arithmetic():
    """bf16 tensors: widened on load, the fp32 arithmetic, rounded once on store -- so one step
    is within one bf16 ulp of the fp32 kernel on the widened values (the interpreter rounds
    toward zero where the GPU rounds to nearest); and stays near the reference."""
    got_p, got_m = _run("triton", torch.bfloat16, 1, wd=0.1, bias="adam")
    params = [p.detach().float() for p in _params(torch.bfloat16)]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16).float() for p in params]
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [{"params": [p for p in ps if p.ndim > 1], "weight_decay": 0.1},
              {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0.0}]
    opt = AdamS(groups, lr=3e-3, impl="triton")
    opt.update.block = BLOCK
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()
    for p, got in zip(ps, got_p):
        exact = p.detach()
        ulp = 2.0 ** (torch.frexp(exact).exponent.float() - 8)     # bf16: 8 significant bits
        assert bool(((got.float() - exact).abs() <= ulp).all())
    ref_p, _ = _run("reference", torch.bfloat16, 3, wd=0.1, bias="adam")
    got_p, _ = _run("triton", torch.bfloat16, 3, wd=0.1, bias="adam")
    for r, g in zip(ref_p, got_p):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)


def test_triton_path_reads_nothing_back_and_launches_per_bucket():
    params = _params()
    opt = AdamS([{"params": params[:3], "weight_decay": 0.1},
                 {"params": params[3:], "weight_decay": 0.0}], impl="triton")
    opt.update.block = BLOCK
    coef = torch.tensor(0.5)
    for t in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        with DeviceOpCounter() as ops:
            opt.step(grad_coef=coef)
    assert ops.host_syncs == 0, ops.sync_sites
    # per group: one launch over the whole blocks, one over the tails; the tables are cached
    assert ops.launches == 4, ops.ops
    numel = sum(p.numel() for p in params)
    assert ops.bytes_moved == 20 * numel


def test_foreach_launches_do_not_grow_with_tensors():
    def launches(n):
        params = [torch.nn.Parameter(torch.randn(8)) for _ in range(n)]
        opt = AdamS(params, impl="foreach")
        for p in params:
            p.grad = torch.randn(8)
        opt.step()
        with DeviceOpCounter() as ops:
            opt.step()
        return ops.launches
    assert launches(3) == launches(40) <= 12


@pytest.mark.parametrize("chunk", [1, 64, 300, 10_000])
def test_cpu_slices_give_the_reference_bits(chunk):
    """Slices cut across tensors and gathered across them, a non-contiguous tensor kept whole:
    every element gets the reference's ops, so the same bits."""
    g = torch.Generator().manual_seed(3)
    shapes = [(16, 32), (300,), (7, 130), (1,), (512,), (3, 5, 17)]
    base = [torch.randn(s, generator=g) for s in shapes]
    base.append(torch.randn(40, 30, generator=g).t())            # non-contiguous
    grads = [torch.randn(b.shape, generator=g) for b in base]
    moms = [torch.randn(b.shape, generator=g) * 0.1 for b in base]
    c = AdamSConstants(4, 3e-3, 0.9, 0.95, 1e-8, 0.1, "adam")
    coef = torch.tensor(0.6)
    ref_p, ref_m = [b.clone() for b in base], [m.clone() for m in moms]
    reference_update(ref_p, grads, ref_m, c, coef)
    got_p, got_m = [b.clone() for b in base], [m.clone() for m in moms]
    chunked_update(got_p, grads, got_m, c, coef, chunk=chunk)
    assert all(torch.equal(r, x) for r, x in zip(ref_p + ref_m, got_p + got_m))


def test_select_update():
    assert select_update("auto", torch.device("cpu")) is chunked_update
    assert select_update("foreach", torch.device("meta")) is foreach_update   # CUDA's: whole bucket
    with pytest.raises(ValueError, match="impl must be one of"):
        select_update("fast", torch.device("cpu"))


def test_triton_refuses_what_it_cannot_address():
    p = torch.nn.Parameter(torch.randn(8, 8).t())     # not contiguous
    opt = AdamS([p], impl="triton")
    p.grad = torch.randn(8, 8)
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    q = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
    opt = AdamS([q], impl="triton")
    q.grad = torch.randn(8, dtype=torch.float64)
    with pytest.raises(TypeError, match="not supported"):
        opt.step()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.LayerNorm(40),
                               torch.nn.Linear(40, 7))


def _train(step_fn, model, steps=4):
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(5, 12, generator=gen)
        model.zero_grad(set_to_none=True)
        (model(x).square().mean() * 50).backward()     # large gradients: clipping acts
        step_fn()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("use_triton", ["auto", "on"])
def test_dense_adams_folds_clipping_into_the_update(use_triton):
    """The strategy (clip coefficient applied inside the update) against clip_grad_norm_ then
    the per-tensor reference, over several steps."""
    from scape_train.optim import build_optimizer
    from scape_train.optim.config import OptimizerConfig

    cfg = OptimizerConfig(name="adams", lr=1e-2, clip_grad=0.5, use_triton=use_triton)
    model = _model()
    strategy = build_optimizer(cfg, model)
    chosen = type(strategy.optimizer.update).__name__
    assert chosen == ("TritonAdamS" if use_triton == "on" else "function"), chosen
    got = _train(lambda: strategy.step(1e-2), model)

    model = _model()
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    ref = AdamS(groups, lr=1e-2, impl="reference")

    def ref_step():
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        ref.step()
    want = _train(ref_step, model)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_fused_adamw_equals_foreach():
    """AdamW's CUDA path (torch's fused kernel; it runs on the CPU too) against foreach."""
    out = []
    for kw in (dict(foreach=True), dict(fused=True)):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
        out.append(_train(opt.step, model))
    for f, u in zip(*out):
        torch.testing.assert_close(u, f, rtol=1e-6, atol=1e-7)
