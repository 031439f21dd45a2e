"""The density schedule's phases (spec §2 line 9): warm-up shapes, the dense phase before the start
step, the cooldown back to density 1, and SCAPE across each boundary on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.config import OptimizerConfig
from scape_train.optim.density import DensitySchedule, density_at, segment_k

from ._dist import run_distributed
from ._optim_common import flat_params, make, train_step
from ._scape_checks import split_run


# -- the pure function ---------------------------------------------------------------------------

def test_linear_and_geometric_warmups():
    lin = DensitySchedule(0.01, 100, "linear")
    geo = DensitySchedule(0.01, 100, "geometric")
    assert lin.at(0) == geo.at(0) == 1.0
    assert lin.at(25) == pytest.approx(1 - 0.99 * 0.25)          # 0.7525
    assert geo.at(50) == pytest.approx(0.1)
    assert lin.at(100) == pytest.approx(0.01) and geo.at(100) == pytest.approx(0.01)
    assert lin.at(10_000) == pytest.approx(0.01)
    # mean density over the ramp: (1+d)/2 against (1-d)/ln(1/d) (the spec's 0.505 vs 0.215)
    assert sum(lin.at(t) for t in range(1, 101)) / 100 == pytest.approx(0.505, abs=0.01)
    assert sum(geo.at(t) for t in range(1, 101)) / 100 == pytest.approx(0.215, abs=0.01)
    assert DensitySchedule(0.1, 100, "constant").at(3) == 0.1
    assert density_at(50, 0.01, 100) == geo.at(50)


def test_start_step_is_dense_before_and_first_sparse_at_t0():
    s = DensitySchedule(0.05, 0, "geometric", start_step=10)
    assert all(s.dense(t) and s.at(t) == 1.0 for t in range(1, 10))
    assert not s.dense(10) and s.at(10) == 0.05
    # with a warm-up the ramp starts at t0 where a run without a start step starts at step 1
    w = DensitySchedule(0.05, 20, "linear", start_step=10)
    plain = DensitySchedule(0.05, 20, "linear")
    assert [w.at(t) for t in range(10, 40)] == [plain.at(t) for t in range(1, 31)]
    # t0 of 0 or 1: no dense phase
    assert DensitySchedule(0.05, 20, "linear", start_step=1).at(1) == plain.at(1) < 1.0


def test_cooldown_rises_geometrically_to_one_at_the_last_step():
    s = DensitySchedule(0.01, 10, "geometric", cooldown_steps=4, total_steps=100)
    assert s.at(96) == pytest.approx(0.01)
    assert [s.at(t) for t in (97, 98, 99)] == pytest.approx([0.01 * 100 ** (i / 4) for i in (1, 2, 3)])
    assert s.at(100) == 1.0                                     # exactly: every residual is sent
    assert s.peak() == 1.0
    # a cooldown overlapping a warm-up never lowers the density
    short = DensitySchedule(0.01, 10, "linear", cooldown_steps=8, total_steps=12)
    assert all(short.at(t) >= DensitySchedule(0.01, 10, "linear").at(t) for t in range(1, 13))


@pytest.mark.parametrize("kw", [dict(warmup_steps=7, shape="linear", start_step=5,
                                     cooldown_steps=6, total_steps=40),
                                dict(warmup_steps=30, start_step=0, cooldown_steps=20,
                                     total_steps=40)])
def test_changing_steps_cover_every_density(kw):
    s = DensitySchedule(0.02, **kw)
    every = {s.at(t) for t in range(1, s.total_steps + 1)}
    assert every == {s.at(t) for t in s.changing_steps()}


# -- exact k: floor(d_t * numel) at round products, no float truncation --------------------------

@pytest.mark.parametrize("shape", ["geometric", "linear"])
@pytest.mark.parametrize("target", [0.1, 0.64, 0.07, 0.29, 0.01, 0.57])
def test_ramp_ends_exactly_at_the_target(shape, target):
    s = DensitySchedule(target, 10, shape)
    assert s.at(10) == target and s.at(11) == target and s.at(10_000) == target
    assert density_at(10, target, 10, shape) == target
    # with a dense phase first and a cooldown at the end the plateau is the target itself
    t = DensitySchedule(target, 10, shape, start_step=5, cooldown_steps=4, total_steps=40)
    assert [t.at(u) for u in range(14, 37)] == [target] * 23


@pytest.mark.parametrize("shape", ["geometric", "linear", "constant"])
@pytest.mark.parametrize("target,numel,k", [(0.1, 100, 10), (0.64, 100, 64), (0.07, 100, 7),
                                            (0.29, 100, 29), (0.57, 100, 57), (0.58, 100, 58),
                                            (0.01, 1000, 10), (0.01, 50, 1), (0.1, 7, 1),
                                            (0.3, 10, 3), (0.7, 10, 7), (0.01, 123_456_700,
                                                                         1_234_567)])
@pytest.mark.parametrize("phases", [dict(), dict(start_step=6),
                                    dict(start_step=3, cooldown_steps=5, total_steps=60)])
def test_segment_k_is_the_floor_of_the_exact_product(shape, target, numel, k, phases):
    s = DensitySchedule(target, 12, shape, **phases)
    steady = [t for t in range(1, 60) if t >= max(1, s.start_step) + 12
              and not (s.cooldown_steps and t > s.total_steps - s.cooldown_steps)]
    assert steady and {segment_k(numel, s.at(t)) for t in steady} == {k}
    # the dense phase and the cooldown's last step keep everything
    if s.start_step:
        assert segment_k(numel, s.at(1)) == numel
    if s.cooldown_steps:
        assert segment_k(numel, s.at(s.total_steps)) == numel


def test_linear_ramp_k_at_round_intermediate_densities():
    # from 1.0 to 0.1 over 10 steps: d_u = 1 - 0.09·u, each a round product with 100
    s = DensitySchedule(0.1, 10, "linear")
    assert [segment_k(100, s.at(u)) for u in range(1, 11)] == [91, 82, 73, 64, 55, 46, 37, 28,
                                                                19, 10]
    assert s.at(10) == 0.1                       # the last warm-up step is the target itself
    # a ramp step whose exact density has no short decimal: 1 - 0.9·u/7, times 7000
    s7 = DensitySchedule(0.1, 7, "linear")
    assert [segment_k(7000, s7.at(u)) for u in range(1, 8)] == [7000 - 900 * u for u in range(1, 8)]
    # the float one rounding below a target still keeps the target's k
    assert segment_k(100, 1.0 + (0.1 - 1.0) * 1.0) == 10


def test_bad_schedules_fail_naming_the_field():
    with pytest.raises(ValueError, match="density_schedule"):
        DensitySchedule(0.1, 10, "cosine")
    with pytest.raises(ValueError, match="cooldown"):
        DensitySchedule(0.1, 10, cooldown_steps=50, total_steps=20)
    with pytest.raises(ValueError, match="start_step"):
        DensitySchedule(0.1, start_step=-1)


# -- SCAPE across the phases, 2 gloo ranks ------------------------------------------------------

STEPS = 8


def phased_cfg(**kw) -> OptimizerConfig:
    base = dict(name="scape", lr=1e-2, density=0.2, density_warmup_steps=2,
                density_schedule="linear", density_start_step=3, density_cooldown_steps=2,
                clip_grad=0.5)
    base.update(kw)
    return OptimizerConfig(**base)


def _full_residual(strategy) -> torch.Tensor:
    full = strategy.reference.full_state()
    return full["residual"] + full.get("shared_residual", 0)


def _phases_worker(rank, world, sharded, impl):
    cfg = phased_cfg(sharded=sharded, scape_impl=impl)
    dense_cfg = OptimizerConfig(**{**cfg.__dict__, "name": "adams", "sharded": False})
    scape, w_scape, _ = make(cfg, total_steps=STEPS)
    dense, w_dense, _ = make(dense_cfg)
    densities = [scape.density(t) for t in range(1, STEPS + 1)]
    recs = []
    for t in range(1, STEPS + 1):
        train_step(scape, w_scape, t, rank)
        if t < cfg.density_start_step:
            train_step(dense, w_dense, t, rank)
        recs.append(dict(p=flat_params(w_scape), p_dense=flat_params(w_dense),
                         m=scape.reference.full_state()["momentum"], e=_full_residual(scape),
                         mask=scape.mask_cur.clone(), state=scape.state_dict()))
    # resume at each phase boundary: k steps, save, load into fresh objects, the rest
    resumed = {}
    for k in (2, 3, 5, 6):
        first, second, w_second, _ = split_run(cfg, rank, k, STEPS, total_steps=STEPS)
        resumed[k] = flat_params(w_second)
        first.close()
        second.close()
    segments = [(s.flat_start, s.numel, scape.layout.excluded[s.tensor])
                for segs in scape.part.segments for s in segs]
    scape.close()
    return dict(recs=recs, densities=densities, resumed=resumed, segments=segments)


@pytest.mark.parametrize("sharded,impl", [(False, "fused"), (True, "fused"),
                                          pytest.param(False, "reference", marks=pytest.mark.slow)])
def test_phases_dense_start_sparse_cooldown_and_resume(sharded, impl):
    results = run_distributed(_phases_worker, 2, (sharded, impl))
    cfg = phased_cfg()
    t0 = cfg.density_start_step
    res = results[0]
    d = res["densities"]
    assert d[:t0 - 1] == [1.0] * (t0 - 1) and d[-1] == 1.0 and min(d) == pytest.approx(0.2)
    for r in results:
        recs = r["recs"]
        # the dense phase is data-parallel AdamS, residuals zero
        for t in range(1, t0):
            torch.testing.assert_close(recs[t - 1]["p"], recs[t - 1]["p_dense"], rtol=1e-6, atol=1e-6)
            assert not recs[t - 1]["e"].any()
        # the first sparse mask is the top-k of the averaged momentum of the last dense step
        m_last_dense, mask_t0 = recs[t0 - 2]["m"], recs[t0 - 1]["mask"]
        expect = torch.zeros_like(mask_t0)
        for start, numel, excluded in res["segments"]:
            k = numel if excluded else segment_k(numel, d[t0 - 1])
            idx = torch.topk(m_last_dense[start:start + numel].abs(), k).indices + start
            expect[idx] = True
        assert 0 < int(mask_t0.sum()) < mask_t0.numel()
        assert torch.equal(mask_t0, expect)
        # the sparse phase keeps mass in the residuals; the cooldown's last step flushes it
        assert recs[t0 - 1]["e"].abs().sum() > 0
        assert recs[-1]["mask"].all() and not recs[-1]["e"].any()
        # exact resume across every boundary
        for k, p in r["resumed"].items():
            assert torch.equal(p, recs[-1]["p"]), f"resume after step {k}"
    # replicas agree
    torch.testing.assert_close(results[0]["recs"][-1]["p"], results[1]["recs"][-1]["p"],
                               rtol=0, atol=0)
