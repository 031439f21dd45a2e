"""The fused SCAPE step (``scape_impl=fused``) against the reference engines (spec §2/§3 line by
line): same masks, parameters, momentum and residuals, in one process and on gloo groups.

Tolerance: the fused engine runs the reference's elementwise ops in the reference's order on
every coordinate, but on k-sized gathered tensors instead of full-size ones, so a coordinate can
fall in a vectorized body (FMA in ``add(alpha=)``/``addcmul``) in one and in a scalar tail
(separate multiply and add) in the other; the Triton passes round ``sqrt`` correctly where
torch's AVX-512 ``sqrt`` may be 1 ulp off, and sum ``‖ĝ‖`` in double. So each step may differ by ~1 ulp per op, and the parameters' gradients then differ by what 1 ulp of a
parameter changes. We check, over 6 steps, every tensor to ``rtol=1e-6`` plus ``1e-6`` of its own
largest entry (a few ulps of the tensor's scale), and exact equality of every mask; the §2
invariants (tests/_scape_checks.py) hold exactly.
"""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.config import OptimizerConfig

from ._dist import run_distributed
from ._optim_common import flat_params, make, train_step
from ._scape_checks import check_invariants, record_run



def _close(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max()) + 1e-12,
                               msg=msg or None)


def _cfg(**kw) -> OptimizerConfig:
    base = dict(name="scape", lr=1e-2, density=0.2, density_schedule="geometric",
                density_warmup_steps=3, clip_grad=0.05)
    base.update(kw)
    return OptimizerConfig(**base)


def _pair_run(rank: int, steps: int = 6, **kw) -> list:
    ref, w_ref, _ = make(_cfg(scape_impl="reference", **kw))
    fus, w_fus, _ = make(_cfg(scape_impl="fused", **kw))
    out = []
    for t in range(1, steps + 1):
        mr = train_step(ref, w_ref, t, rank)
        mf = train_step(fus, w_fus, t, rank)
        sr, sf = ref.reference.full_state(), fus.reference.full_state()
        out.append(dict(p=(flat_params(w_ref), flat_params(w_fus)),
                        state={k: (sr[k], sf[k]) for k in sr},
                        mask=(ref.mask_cur.clone(), fus.mask_cur.clone()),
                        next=(ref.next_mask().clone(), fus.next_mask().clone()),
                        metrics=(mr, mf)))
    ref.close()
    fus.close()
    return out


def _compare(runs: list) -> None:
    for rec in runs:
        for key in ("mask", "next"):
            assert torch.equal(*rec[key]), key
        _close(*rec["p"])
        for k, (a, b) in rec["state"].items():
            _close(a, b, msg=k)
        mr, mf = rec["metrics"]
        for k in ("grad_norm", "scape/residual_norm", "scape/payload_numel", "scape/density"):
            assert mf[k] == pytest.approx(mr[k], rel=1e-5, abs=1e-12), k


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("bias_correction", ["adam", "official", "none"])
def test_fused_equals_reference_one_worker(sharded, bias_correction):
    _compare(_pair_run(0, sharded=sharded, bias_correction=bias_correction))


@pytest.mark.parametrize("coding", ["elias_fano", "bitmap", "indices"])
def test_decoded_indices_equal_the_mask(coding):
    """The torch decode hands the step the mask's sorted indices and writes no bool mask for
    Elias-Fano (with all-ones segments); the others hand the bool mask, and the update takes
    nonzero_static of it (the Triton decode's indices: tests/test_triton_codecs.py). All give the same step, and no
    byte-per-element mask outlives one."""
    _compare(_pair_run(0, mask_coding=coding, density_warmup_steps=0))
    s, w, _ = make(_cfg(mask_coding=coding, density_warmup_steps=0))
    seen = []
    orig = s.fused.update

    def spy(mask, lr, step, counts, **kw):
        k = sum(map(sum, counts))
        seen.append((mask.indices is not None, mask._dense is not None, mask.bits is not None))
        out = orig(mask, lr, step, counts, **kw)
        assert torch.equal(mask.indices, torch.nonzero(mask.dense(keep=False)).view(-1))
        assert mask.indices.numel() == k
        return out

    s.fused.update = spy
    for t in range(1, 4):
        train_step(s, w, t, 0)
        assert s._cur._dense is None or coding == "bitmap"   # none kept past the step
    given = coding == "elias_fano"
    assert seen[1:] == [(given, not given, False)] * 2     # step 1's mask is built synchronously


def test_fused_default_and_invariants_one_worker():
    assert OptimizerConfig().scape_impl == "fused"
    strategy, wrapped, _ = make(_cfg(clip_grad=0.0, partitioner="flat", density=0.15))
    check_invariants([record_run(strategy, wrapped, 0, steps=4)], clip_active=False)


def test_an_offloaded_residual_runs_the_reference_engine():
    s, _, _ = make(_cfg(offload_residuals=True, offload_chunk_numel=37))
    assert s.fused is None


@pytest.mark.parametrize("payload", ["bf16", "fp8_e4m3"])
def test_fused_takes_a_low_precision_payload_in_sharded_mode(payload):
    """The coded reduce-scatter's error lands in ε[M], and the owners send coded parameter
    updates with their update residual u, as the reference does; ρ stays zero on the mask, so
    m's support is kept and the fused step stays on it."""
    _compare(_pair_run(0, payload_dtype=payload, sharded=True))
    s, w, _ = make(_cfg(payload_dtype=payload, sharded=True))
    for t in range(1, 6):
        train_step(s, w, t, 0)
    assert (s.last_engine is s.fused) and s.fused._pidx is not None
    s.close()


@pytest.mark.parametrize("payload", ["bf16", "fp8_e4m3"])
def test_fused_takes_a_low_precision_payload_in_replicated_mode(payload):
    """The quantization error lands in e[M] as the reference puts it there; the fused step
    then forgets m's support (e is nonzero on it), so every step after takes its general
    prepare."""
    runs = _pair_run(0, payload_dtype=payload)
    _compare(runs)
    s, w, _ = make(_cfg(payload_dtype=payload))
    for t in range(1, 6):
        train_step(s, w, t, 0)
    assert (s.last_engine is s.fused) and s.fused._pidx is None
    s.close()


def _dist_worker(rank, world, sharded, partitioner, coding, payload="fp32"):
    return _pair_run(rank, sharded=sharded, partitioner=partitioner, mask_coding=coding,
                     payload_dtype=payload)


@pytest.mark.dist
@pytest.mark.parametrize("world,sharded,partitioner,coding,payload", [
    (2, False, "tensor", "auto", "fp32"), (3, True, "flat", "elias_fano", "fp32"),
    (3, False, "flat", "auto", "fp8_e4m3"), (3, True, "tensor", "elias_fano", "fp8_e4m3"),
    pytest.param(2, True, "flat", "auto", "bf16", marks=pytest.mark.slow),
    pytest.param(4, True, "tensor", "auto", "fp32", marks=pytest.mark.slow),
    pytest.param(3, False, "flat", "elias_fano", "fp32", marks=pytest.mark.slow),
    pytest.param(2, False, "tensor", "indices", "bf16", marks=pytest.mark.slow)])
def test_fused_equals_reference_distributed(world, sharded, partitioner, coding, payload):
    for runs in run_distributed(_dist_worker, world, (sharded, partitioner, coding, payload)):
        _compare(runs)


def test_a_density_warmup_starts_on_the_reference_path_and_switches_to_the_fused_one():
    """Step 1 of a geometric warm-up sends every coordinate (the reference path's full-size
    passes are the cheaper ones there); once the mask is sparse the fused path takes over, and
    the run still equals the reference engine's (the comparisons above run this schedule)."""
    s, w, _ = make(_cfg())
    paths = []
    for t in range(1, 6):
        train_step(s, w, t, 0)
        paths.append((s.last_engine is s.fused))
    s.close()
    assert paths[0] is False and paths[-1] is True, paths


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("use_triton", ["on", "off"])
def test_next_topk_runs_while_the_payload_collective_is_in_flight(sharded, use_triton,
                                                                  monkeypatch):
    """M_{t+1}'s top-k needs the candidate, not the averaged payload: the fused step starts the
    payload's collective asynchronously, runs the top-k, then waits."""
    from scape_train.optim.scape import strategy as scape_strategy

    if use_triton == "on":
        pytest.importorskip("triton")
    s, w, _ = make(_cfg(sharded=sharded, density_warmup_steps=0, use_triton=use_triton))
    events: list = []
    op = "reduce_scatter" if sharded else "all_reduce"
    collective = getattr(s.comm, op)

    def watched(*a, kind, async_op=False, **kw):
        handle = collective(*a, kind=kind, async_op=async_op, **kw)
        if kind == "payload":
            events.append(("start", async_op))
            wait = handle.wait
            handle.wait = lambda: (events.append("wait"), wait())[1]
        return handle

    topk = scape_strategy.topk_own_mask
    monkeypatch.setattr(s.comm, op, watched)
    monkeypatch.setattr(scape_strategy, "topk_own_mask",
                        lambda *a, **k: (events.append("top-k"), topk(*a, **k))[1])
    for t in range(1, 4):
        events.clear()
        train_step(s, w, t, 0)
    assert (s.last_engine is s.fused)
    assert events == [("start", True), "top-k", "wait"]


def test_the_deferred_fold_is_skipped_by_the_next_prepare_and_applied_for_any_other_reader():
    """The replicated Triton step leaves ``e[M] = 0`` to the next reader: the next prepare
    overwrites those positions and skips it; state readers get it applied. Stepping without
    reading any state in between (so the skip is taken every step) must still equal the
    reference engine."""
    pytest.importorskip("triton")
    ref, w_ref, _ = make(_cfg(scape_impl="reference", density_warmup_steps=0))
    fus, w_fus, _ = make(_cfg(scape_impl="fused", density_warmup_steps=0, use_triton="on"))
    store = fus.reference.state.residual
    skipped = []
    overwriting = store.overwriting
    store.overwriting = lambda idx: (skipped.append(store._deferred is idx), overwriting(idx))[1]
    for t in range(1, 7):
        train_step(ref, w_ref, t, 0)
        train_step(fus, w_fus, t, 0)
    assert skipped and all(skipped)            # every prepare after step 1 skipped the fold
    assert store._deferred is not None
    mask = fus.mask_cur
    assert torch.equal(mask, ref.mask_cur)
    e = store.full()                            # a reader: the fold is applied
    assert store._deferred is None and not e[mask].any()
    _close(flat_params(w_ref), flat_params(w_fus))
    sr, sf = ref.reference.full_state(), fus.reference.full_state()
    for k in sr:
        _close(sr[k], sf[k], msg=k)


@pytest.mark.parametrize("use_triton", ["off", "on"])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_segment_without_ones_still_gets_its_weight_decay(sharded, use_triton):
    """The passes decay θ as they walk the mask's segments; a segment whose mask holds no one
    (a mask measured from a checkpoint of another partition can leave one so) has an empty
    slice, which the same walk decays (torch ops and Triton kernels). The fused step after such
    a load equals the reference step, that tensor included."""
    from scape_train.optim.scape.kernels import pack_bits, unpack_bits

    runs = {}
    for impl in ("reference", "fused"):
        s, w, model = make(_cfg(scape_impl=impl, sharded=sharded, density_warmup_steps=0,
                                use_triton=use_triton))
        for t in range(1, 3):
            train_step(s, w, t, 0)
        state = s.state_dict()
        name = next(n for n, wd in zip(s.layout.names, s.layout.weight_decay) if wd > 0
                    and n in state["mask_next"])
        p = dict(model.named_parameters())[name]
        bits = unpack_bits(state["mask_next"][name], p.numel())
        assert bits.any()
        state["mask_next"][name] = pack_bits(torch.zeros_like(bits))
        state["partitioner"] = "flat"       # "another partition": the counts are measured
        s.load_state_dict(state)
        before = p.detach().clone()
        train_step(s, w, 3, 0)
        assert impl == "reference" or (s.last_engine is s.fused)
        runs[impl] = (flat_params(w), p.detach().clone(), before)
        s.close()
    for impl, (_, p_new, before) in runs.items():     # the decay alone, bit for bit
        assert torch.equal(p_new, before * (1.0 - 1e-2 * 0.1)), impl
    _close(runs["reference"][0], runs["fused"][0])


