"""SCAPE's wire format on real gloo groups: every mask coding leaves SCAPE bit-identical (spec
invariants, sharded ≡ replicated); low-precision payloads conserve candidate mass with their
quantization error; counted bytes equal the accounting kind by kind for every coding and dtype;
resume is bit-exact with each format."""

from __future__ import annotations

import itertools

import pytest
import torch

from scape_train.optim.config import OptimizerConfig
from scape_train.optim.scape.accounting import scape_step_bytes
from scape_train.optim.scape.partition import ParamLayout

from ._dist import run_distributed
from ._optim_common import flat_params, make, sent_bytes_per_kind, tiny_model, train_step
from ._scape_checks import (assert_states_equal, check_invariants, elementwise, record_run,
                            resume_and_offload_run)

pytestmark = pytest.mark.dist

CODINGS = ["bitmap", "indices", "elias_fano", "auto"]
LOWP = ["bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"]
U = 2.0 ** -24      # fp32 unit roundoff


def cfg_of(**kw) -> OptimizerConfig:
    base = dict(name="scape", lr=1e-2, density=0.05, density_schedule="geometric",
                density_warmup_steps=3, clip_grad=0.0, partitioner="flat")
    base.update(kw)
    return OptimizerConfig(**base)


# -- every coding: invariants, bit-identical to bitmap, sharded ≡ replicated ----------------------

def _codings_worker(rank, world):
    out = {}
    for coding in CODINGS:
        rep, w_rep, _ = make(cfg_of(mask_coding=coding))
        rec = record_run(rep, w_rep, rank, steps=4)
        sh, w_sh, _ = make(cfg_of(mask_coding=coding, sharded=True))
        p_sh = []
        for t in range(1, 5):
            train_step(sh, w_sh, t, rank)
            p_sh.append(flat_params(w_sh))
        out[coding] = dict(rec=rec, p_sh=p_sh, mask_sh=sh.mask_cur.clone(),
                           m_sh=sh.reference.full_state()["momentum"])
        rep.close()
        sh.close()
    return out


def test_every_coding_keeps_scape_exact():
    world = 3
    results = run_distributed(_codings_worker, world)
    for coding in CODINGS:
        check_invariants([res[coding]["rec"] for res in results], clip_active=False)
        for rank, res in enumerate(results):
            ref, got = res["bitmap"], res[coding]
            for a, b in zip(ref["rec"]["recs"], got["rec"]["recs"]):   # bit for bit
                for key in ("after", "m", "e", "mask", "next"):
                    assert torch.equal(a[key], b[key]), (coding, key)
            for a, b in zip(ref["p_sh"], got["p_sh"]):
                assert torch.equal(a, b), coding
            assert torch.equal(ref["m_sh"], got["m_sh"])
            # sharded equals replicated (to rounding), masks exactly
            for p, r in zip(got["p_sh"], got["rec"]["recs"]):
                torch.testing.assert_close(p, r["after"], rtol=1e-5, atol=1e-6)
            assert torch.equal(got["mask_sh"], got["rec"]["recs"][-1]["mask"])
            torch.testing.assert_close(got["m_sh"], got["rec"]["recs"][-1]["m"],
                                       rtol=1e-5, atol=1e-6)
            assert torch.equal(got["p_sh"][-1], results[0][coding]["p_sh"][-1])
        # the coded masks are smaller than the bitmap at this density (5%)
        if coding != "bitmap":
            sb = results[0][coding]["rec"]["shard_bytes"]
            assert sb[3] < results[0]["bitmap"]["rec"]["shard_bytes"][3], (coding, sb)


# -- low-precision payloads: replicas identical, mass conserved with the quantization error -------

def _lowp_worker(rank, world):
    out = {}
    for dtype in LOWP:
        rep, w_rep, _ = make(cfg_of(payload_dtype=dtype, mask_coding="auto"))
        rep.keep_intermediates()
        recs = []
        for t in range(1, 5):
            before = flat_params(w_rep)
            train_step(rep, w_rep, t, rank)
            last = rep.last_engine.last
            recs.append(dict(c=last["c"], payload=last["payload"], err=last["wire_error"],
                             e=rep.reference.state.residual.full(), m=rep.reference.state.m.clone(),
                             mask=rep.mask_cur.clone(), next=rep.next_mask().clone(),
                             before=before, after=flat_params(w_rep)))
        sh, w_sh, _ = make(cfg_of(payload_dtype=dtype, mask_coding="elias_fano", sharded=True))
        sh.keep_intermediates()
        srecs = []
        for t in range(1, 5):
            before = flat_params(w_sh)
            train_step(sh, w_sh, t, rank)
            last = sh.last_engine.last
            own = sh.mask_cur[sh.reference.lo:sh.reference.hi]
            srecs.append(dict(x=last["x"], reduced=last["reduced"], err=last["wire_error"],
                              eps=sh.reference.state.residual.full(), mask=sh.mask_cur.clone(),
                              target=last["update_target"], sent=last["update_sent"],
                              u=sh.reference.state.update_residual[own].clone(),
                              before=before, after=flat_params(w_sh)))
        lay = rep.layout
        out[dtype] = dict(recs=recs, srecs=srecs, wd=elementwise(lay, lay.weight_decay),
                          ranges=sh.part.ranges)
        rep.close()
        sh.close()
    return out


def test_low_precision_payload_conserves_mass():
    world = 3
    results = run_distributed(_lowp_worker, world)
    for dtype in LOWP:
        info = results[0][dtype]
        # replicated: Σ_r c^(r) = n·b̃ + Σ_r e^(r) on the mask (to the fp32 rounding of the sum)
        for t in range(4):
            recs = [res[dtype]["recs"][t] for res in results]
            r0 = recs[0]
            mask = r0["mask"]
            for r in recs[1:]:
                for key in ("after", "m", "mask", "next", "payload"):
                    assert torch.equal(r[key], r0[key]), (dtype, t, key)
            for r in recs:
                assert torch.equal(r["e"][~mask], r["c"][~mask])     # off the mask: e = c
                assert torch.equal(r["e"][mask], r["err"])           # on it: the wire error
            c = torch.stack([r["c"][mask] for r in recs]).double()
            e = torch.stack([r["e"][mask] for r in recs]).double()
            b = r0["payload"].double()
            gap = (c.sum(0) - world * b - e.sum(0)).abs()
            bound = 8 * U * (world * c.abs().sum(0) + 2 * world * b.abs() + e.abs().sum(0))
            assert torch.all(gap <= bound), (dtype, t, float((gap - bound).max()))
            assert float(e.abs().max()) > 0                          # it did quantize
            # the momentum is the (dequantized) mean, off the mask zero; θ off-mask decays only
            torch.testing.assert_close(r0["m"][mask], r0["payload"], rtol=1e-5, atol=1e-7)
            assert torch.all(r0["m"][~mask] == 0)
            decayed = r0["before"] * (1.0 - 1e-2 * info["wd"])
            assert torch.equal(r0["after"][~mask], decayed[~mask])
            rtol = {"bf16": 2 ** -7, "fp8_e4m3": 2 ** -2, "fp8_e5m2": 2 ** -1,
                    "fp4_e2m1": 2 ** -1}[dtype]
            mean_c = c.mean(0)
            assert torch.all((b - mean_c).abs() <= rtol * mean_c.abs().max())
        # sharded: Σ_r x^(r) = n·S + Σ_r ε^(r) on the mask; the owners' updates conserved exactly
        for t in range(4):
            recs = [res[dtype]["srecs"][t] for res in results]
            r0 = recs[0]
            mask = r0["mask"]
            for r in recs[1:]:
                assert torch.equal(r["after"], r0["after"]), (dtype, t)
            for r in recs:
                assert torch.equal(r["eps"][~mask], r["x"][~mask])
                assert torch.equal(r["eps"][mask], r["err"])
                # applied update + new update residual = update + old residual, bit for bit
                assert torch.equal(r["sent"] + r["u"], r["target"])
            x = torch.stack([r["x"][mask] for r in recs]).double()
            eps = torch.stack([r["eps"][mask] for r in recs]).double()
            s = torch.cat([r["reduced"] for r in recs]).double()    # owners' means, owner order
            gap = (x.sum(0) - world * s - eps.sum(0)).abs()
            bound = 8 * U * (world * x.abs().sum(0) + world * s.abs())
            assert torch.all(gap <= bound), (dtype, t)
            decayed = r0["before"] * (1.0 - 1e-2 * info["wd"])
            assert torch.equal(r0["after"][~mask], decayed[~mask])
            sent = torch.cat([r["sent"] for r in recs])
            torch.testing.assert_close(r0["after"][mask], decayed[mask] + sent, rtol=0,
                                       atol=4 * U * float(r0["after"].abs().max()))


# -- counted bytes = accounting, kind by kind, every coding and dtype -----------------------------

BYTE_CASES = [(sharded, partitioner, coding, dtype)
              for (sharded, partitioner), coding, dtype in itertools.product(
                  [(False, "flat"), (False, "tensor"), (True, "flat"), (True, "tensor")],
                  CODINGS, ["fp32"] + LOWP)]
WIDTH = 40


def _bytes_worker(rank, world):
    out = []
    for sharded, partitioner, coding, dtype in BYTE_CASES:
        cfg = OptimizerConfig(name="scape", density=0.07, density_warmup_steps=0,
                              sharded=sharded, partitioner=partitioner, mask_coding=coding,
                              payload_dtype=dtype, use_triton="off")
        strategy, wrapped, _ = make(cfg, width=WIDTH)
        per_step = sent_bytes_per_kind(strategy, wrapped, (1, 2), rank)
        strategy.close()
        out.append(per_step)
    return out


def test_counted_bytes_equal_accounting_for_every_format():
    world = 3
    results = run_distributed(_bytes_worker, world)
    layout = ParamLayout(tiny_model(width=WIDTH), weight_decay=0.1, exclude_norm_bias=True)
    seen = set()
    for i, (sharded, partitioner, coding, dtype) in enumerate(BYTE_CASES):
        want = scape_step_bytes(layout, world, 0.07, partitioner=partitioner, sharded=sharded,
                                mask_coding=coding, payload_dtype=dtype).as_dict()
        seen.add(want["total"])
        for rank, res in enumerate(results):
            first, steady = res[i]
            for kind in ("payload", "mask", "params", "norm"):
                assert steady.get(kind, 0) == want[kind], (BYTE_CASES[i], rank, kind, steady)
            assert first.get("mask", 0) == 2 * want["mask"]     # + the synchronous M_1
            assert set(steady) <= {"payload", "mask", "params", "norm"}
    assert len(seen) > len(BYTE_CASES) // 2                      # the formats really differ


# -- resume is bit-exact with each format ---------------------------------------------------------

RESUME_CASES = [(sharded, dtype, coding) for sharded in (False, True)
                for dtype, coding in [("fp32", "auto"), ("bf16", "indices"),
                                      ("fp8_e4m3", "elias_fano"), ("fp8_e5m2", "bitmap")]]


def _resume_worker(rank, world):
    out = []
    for sharded, dtype, coding in RESUME_CASES:
        cfg = cfg_of(density=0.2, sharded=sharded, clip_grad=0.5, density_warmup_steps=4,
                     payload_dtype=dtype, mask_coding=coding)
        out.append(resume_and_offload_run(cfg, rank))
    return out


def test_resume_is_bit_exact_with_each_format():
    results = run_distributed(_resume_worker, 2)
    for i, (sharded, dtype, coding) in enumerate(RESUME_CASES):
        for res in results:
            r = res[i]
            assert torch.equal(r["p_full"], r["p_resumed"]), RESUME_CASES[i]
            assert torch.equal(r["p_ref"], r["p_off"]), RESUME_CASES[i]
            assert_states_equal(r["s_full"], r["s_resumed"], str(RESUME_CASES[i]))
            assert_states_equal(r["s_ref"], r["s_off"], str(RESUME_CASES[i]))
            # only the sharded low-precision engine adds state (its update residual)
            assert ("wire" in r["saved_keys"]) == (sharded and dtype != "fp32")
