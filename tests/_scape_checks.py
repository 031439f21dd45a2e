"""Record SCAPE steps on each rank and check the spec §2 invariants over all ranks' records."""

from __future__ import annotations

import io

import torch

from scape_train.metrics import read_on_host

from scape_train.comm import ring_all_gather_bytes, ring_all_reduce_bytes
from scape_train.optim.density import segment_k

from scape_train.optim.config import OptimizerConfig

from ._optim_common import batch, flat_params, loss_fn, make, train_step


def elementwise(layout, values: list[float]) -> torch.Tensor:
    return torch.cat([torch.full((n,), float(v)) for n, v in zip(layout.numels, values)])


def record_run(strategy, wrapped, rank: int, steps: int, lr: float = 1e-2) -> dict:
    """Train ``steps`` steps of replicated SCAPE, keeping everything the checks need."""
    strategy.keep_intermediates()
    lay = strategy.layout
    recs = []
    for t in range(1, steps + 1):
        before = flat_params(wrapped)
        strategy.comm.pop_stats()
        x, y = batch(t, rank)
        loss_fn(wrapped, x, y).backward()
        metrics = read_on_host(strategy.step(lr))
        strategy.zero_grad()
        stats = strategy.comm.pop_stats()
        recs.append(dict(before=before, after=flat_params(wrapped), metrics=metrics, stats=stats,
                         c=strategy.last_engine.last["c"], payload=strategy.last_engine.last["payload"],
                         m_prev=strategy.last_engine.last["m_prev"], m=strategy.reference.state.m.clone(),
                         e=strategy.reference.state.residual.full(), mask=strategy.mask_cur.clone(),
                         next=strategy.next_mask().clone(), lr=lr))
    return dict(recs=recs, wd=elementwise(lay, lay.weight_decay),
                segments=strategy.part.segments, ranges=strategy.part.ranges,
                excluded=list(lay.excluded), density=[strategy.density(t) for t in
                                                      range(steps + 2)],
                betas=tuple(strategy.cfg.betas),
                # bytes each rank sends into the all-gather of a mask built at d_t, by t
                shard_bytes=[strategy.exchange.shard_bytes_at(strategy.density(t))
                             for t in range(steps + 2)])


def check_invariants(results: list[dict], clip_active: bool) -> None:
    n = len(results)
    info = results[0]
    steps = len(info["recs"])
    for t in range(steps):
        recs = [res["recs"][t] for res in results]
        r0 = recs[0]
        mask = r0["mask"]
        # replicas identical after every step
        for r in recs[1:]:
            for key in ("after", "m", "mask", "next"):
                assert torch.equal(r[key], r0[key]), f"step {t + 1}: {key} differs across ranks"
        for rank, r in enumerate(recs):
            # conservation: c = M⊙c + e exactly, e = 0 on the mask
            assert torch.equal(r["e"], r["c"].masked_fill(mask, 0.0))
            assert torch.equal(torch.where(mask, r["c"], 0.0) + r["e"], r["c"])
        # off the mask: m = 0 and θ_t = (1 - lr·wd)·θ_{t-1}
        assert torch.all(r0["m"][~mask] == 0)
        decayed = r0["before"] * (1.0 - r0["lr"] * info["wd"])
        assert torch.equal(r0["after"][~mask], decayed[~mask])
        # payload: popcount long, the mean of every rank's candidate on the mask
        ones = int(mask.sum())
        assert r0["metrics"]["scape/payload_numel"] == ones == r0["payload"].numel()
        mean_c = torch.stack([r["c"][mask] for r in recs]).mean(0)
        torch.testing.assert_close(r0["payload"], mean_c, rtol=1e-5, atol=1e-7)
        if not clip_active:   # m_t = M ⊙ b̄
            torch.testing.assert_close(r0["m"][mask], r0["payload"], rtol=1e-5, atol=1e-7)
        # next mask: exactly k per owned segment, all ones on excluded tensors, and it is the
        # owner's top-k of its own candidate from this step
        d_next = info["density"][t + 2]
        for owner, segs in enumerate(info["segments"]):
            c_owner = recs[owner]["c"]
            for seg in segs:
                sl = slice(seg.flat_start, seg.flat_start + seg.numel)
                bits = r0["next"][sl]
                if info["excluded"][seg.tensor]:
                    assert bits.all()
                    continue
                k = segment_k(seg.numel, d_next)
                assert int(bits.sum()) == k
                top = torch.topk(c_owner[sl].abs(), k).indices
                expect = torch.zeros_like(bits)
                expect[top] = True
                assert torch.equal(bits, expect), f"step {t + 1}: next mask is not owner top-k"
        # the mask used at step t+1 is the one gathered at step t
        if t + 1 < steps:
            assert torch.equal(results[0]["recs"][t + 1]["mask"], r0["next"])
        # counted bytes: one payload all-reduce and one packed-mask all-gather
        if n > 1:
            st = r0["stats"]
            assert st["comm/payload_sent_bytes"] == ring_all_reduce_bytes(ones * 4, n)
            # M_{t+1}, and at step 1 also M_1 (built synchronously)
            shard = info["shard_bytes"][t + 2] + (info["shard_bytes"][1] if t == 0 and
                                                  info["density"][1] < 1 else 0)
            assert st.get("comm/mask_sent_bytes", 0) == ring_all_gather_bytes(shard, n)


def split_run(cfg: OptimizerConfig, rank: int, k: int, steps: int, **make_kw):
    """``k`` steps, the optimizer and model saved and loaded into fresh objects (other initial
    weights), then steps ``k+1..steps``: (first, second, second's model, the saved state)."""
    first, w_first, _ = make(cfg, **make_kw)
    for t in range(1, k + 1):
        train_step(first, w_first, t, rank)
    buf = io.BytesIO()
    torch.save({"opt": first.state_dict(), "model": w_first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    second, w_second, _ = make(cfg, seed=123, **make_kw)
    w_second.load_state_dict(saved["model"])
    second.load_state_dict(saved["opt"])
    for t in range(k + 1, steps + 1):
        train_step(second, w_second, t, rank)
    return first, second, w_second, saved


def resume_and_offload_run(cfg: OptimizerConfig, rank: int, n: int = 3) -> dict:
    """2n steps straight; 2n with the residual offloaded (odd chunks) beside 2n straight on the
    engine offload runs on (the reference: ``p_off``/``s_off`` against ``p_ref``/``s_ref``);
    and n + save/load into fresh objects with other initial weights + n: parameters and
    optimizer states of all."""
    full, w_full, _ = make(cfg)
    for t in range(1, 2 * n + 1):
        train_step(full, w_full, t, rank)
    ref_cfg = {**cfg.__dict__, "scape_impl": "reference"}
    off, w_off, _ = make(OptimizerConfig(**{**ref_cfg, "offload_residuals": True,
                                            "offload_chunk_numel": 37}))
    ref, w_ref, _ = make(OptimizerConfig(**ref_cfg))
    for t in range(1, 2 * n + 1):
        train_step(off, w_off, t, rank)
        train_step(ref, w_ref, t, rank)
    first, second, w_second, saved = split_run(cfg, rank, n, 2 * n)
    out = dict(p_full=flat_params(w_full), p_resumed=flat_params(w_second),
               p_off=flat_params(w_off), p_ref=flat_params(w_ref), s_full=full.state_dict(),
               s_resumed=second.state_dict(), s_off=off.state_dict(), s_ref=ref.state_dict(),
               saved_keys=sorted(saved["opt"]))
    for s in (full, off, ref, first, second):
        s.close()
    return out


def assert_states_equal(a, b, where: str = "") -> None:
    """Nested optimizer states equal: tensors bit for bit, everything else by value."""
    assert a.keys() == b.keys(), where
    for k in a:
        if isinstance(a[k], dict):
            assert_states_equal(a[k], b[k], f"{where}.{k}")
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{where}.{k}"
        else:
            assert a[k] == b[k], f"{where}.{k}"
