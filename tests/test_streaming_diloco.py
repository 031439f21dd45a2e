"""Streaming DiLoCo (``strategy=diloco strategy.fragments=F``): one fragment per round, every H/F
steps; each round against DiLoCo's rule on that fragment alone (2 gloo ranks), its bytes, the
fragments' assignment, exact resume with a fragment's exchange in flight, and the refusals."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from scape_train.comm import Comm, ring_all_reduce_bytes
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.local import StrategyConfig, build_local_strategy, validate
from scape_train.optim.local.fragments import fragments
from tests._dist import run_distributed
from tests._optim_common import batch, flat_params, loss_fn, tiny_model

OPT = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1)
CFG = dict(name="diloco", inner_steps=4, fragments=2, outer_lr=0.7, outer_momentum=0.9)


def test_fragments_stride_the_blocks_and_balance_the_rest():
    names = ["tok_emb.weight", *(f"layers.{i}.{w}" for i in range(4) for w in ("a", "b")),
             "norm.weight", "lm_head.weight"]
    numels = [100, *([10] * 8), 4, 100]
    parts = fragments(names, numels, 2)
    assert sorted(i for part in parts for i in part) == list(range(len(names)))   # each once
    by_name = [{names[i] for i in part} for part in parts]
    assert {"layers.0.a", "layers.2.b"} <= by_name[0] and {"layers.1.a", "layers.3.b"} <= by_name[1]
    # the embedding and the head, the largest, go to different fragments
    assert ("tok_emb.weight" in by_name[0]) != ("lm_head.weight" in by_name[0])
    assert fragments(names, numels, 1) == [list(range(len(names)))]
    with pytest.raises(ValueError, match="without a tensor"):
        fragments(names[:2], numels[:2], 3)


def _make(seed: int = 0, comm: Comm | None = None, **over):
    model = tiny_model(seed)
    return build_local_strategy(StrategyConfig(**{**CFG, **over}), OPT, model,
                                comm or Comm()), model


class GatherOnly(Comm):
    """A group without an all-to-all, as torchft's replica groups."""
    offers_all_to_all = False


def _steps(strategy, model, first: int, last: int, rank: int) -> list[dict]:
    out = []
    for step in range(first, last + 1):
        strategy.before_forward(step)
        loss_fn(model, *batch(step, rank)).backward()
        out.append(strategy.step(1e-2))
        strategy.zero_grad()
    return out


def _rule_worker(rank, world):
    """Every round's outcome against DiLoCo's rule on its fragment, the rest untouched."""
    strategy, model = _make()
    outer = strategy.outer
    checks = []
    original = outer.round

    def checked_round(t):
        frag = outer.fragment_of(t)
        params = [p.detach().clone() for p in strategy.params]
        anchor = [a.clone() for a in outer.state.anchor]
        y_prev = [y.clone() for y in outer.state.y_prev]
        drifts = [(a - p).double() for a, p in zip(anchor, params)]
        for d in drifts:                       # the mean over workers, in float64
            dist.all_reduce(d)
            d.div_(world)
        strategy.comm.pop_stats()
        metrics = original(t)
        sent = strategy.comm.pop_stats()
        inside = {id(p) for p in frag.params}
        ok = True
        for i, p in enumerate(strategy.params):
            if id(p) in inside:
                y = anchor[i].double() - 0.7 * drifts[i]
                x = y + 0.9 * (y - y_prev[i].double())
                ok &= torch.allclose(p.double(), x, rtol=0, atol=1e-6)
                ok &= torch.equal(outer.state.anchor[i], p.detach())
            else:                               # trains on: theta, theta0, y_prev as they were
                ok &= torch.equal(p.detach(), params[i])
                ok &= torch.equal(outer.state.anchor[i], anchor[i])
                ok &= torch.equal(outer.state.y_prev[i], y_prev[i])
        numel = sum(p.numel() for p in frag.params)
        checks.append({"ok": bool(ok), "fragment": metrics["outer/fragment"],
                       "sent": sent.get("comm/outer_sent_bytes"), "numel": numel})
        return metrics

    outer.round = checked_round
    strategy.comm.pop_stats()
    log = _steps(strategy, model, 1, 8, rank)
    return {"checks": checks, "progress": strategy.progress(8),
            "rounds": [m.get("outer/round") for m in log]}


def test_each_round_is_diloco_on_its_fragment_and_sends_only_it():
    res = run_distributed(_rule_worker, 2)
    for r in res:
        checks = r["checks"]
        assert [c["fragment"] for c in checks] == [0.0, 1.0, 0.0, 1.0]   # a round every H/F = 2
        assert all(c["ok"] for c in checks), checks
        for c in checks:
            assert c["sent"] == ring_all_reduce_bytes(4 * c["numel"], 2)
        assert sum(c["numel"] for c in checks[:2]) == sum(p.numel() for p in tiny_model().parameters())
        assert r["progress"] == 8
    assert res[0]["checks"] == res[1]["checks"]


def _resume_worker(rank, world, tau):
    """Cut at step 8, just after fragment 1's round (fragment 0 trained two steps past its
    anchor; with tau = 1, fragment 1's exchange in flight): the resumed run ends bit for bit
    where the straight run ends."""
    straight, m1 = _make(overlap_steps=tau)
    _steps(straight, m1, 1, 12, rank)
    first, m2 = _make(overlap_steps=tau)
    _steps(first, m2, 1, 8, rank)
    assert first.outer.in_flight == (1 if tau else 0)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second, m3 = _make(seed=123, overlap_steps=tau)
    second.load_state_dict(torch.load(buf, weights_only=True))
    _steps(second, m3, 9, 12, rank)
    return torch.equal(flat_params(m1), flat_params(m3))


@pytest.mark.parametrize("tau", [0, 1], ids=["blocking", "in_flight"])
def test_resume_between_fragments_rounds_is_exact(tau):
    assert all(run_distributed(_resume_worker, 2, (tau,)))


@pytest.mark.parametrize("over,words", [
    (dict(fragments=0), "fragments must be >= 1"),
    (dict(name="gasloc", topology="2peer"), "applies to strategy=diloco"),
    (dict(inner_steps=30, fragments=4), "must divide inner_steps=30"),
    (dict(overlap_steps=2), r"overlap_steps \(tau\) must be < inner_steps / fragments = 2"),
    (dict(round_budget_s=5.0), "drop inner_steps_per_worker and round_budget_s"),
])
def test_bad_fragment_configs_are_refused_by_name(over, words):
    with pytest.raises(ValueError, match=words):
        validate(StrategyConfig(**{**CFG, **over}), OPT, 2)


def test_the_summary_line_names_the_fragments():
    from scape_train.summary import _strategy_line
    from tests.helpers import compose_config

    line = _strategy_line(compose_config(["strategy=diloco", "optimizer=adamw",
                                          "strategy.fragments=3", "trainer.max_steps=300"]))
    assert line.startswith("diloco, H=30, ~30 rounds")
    assert line.endswith("streaming: 3 fragments, one synchronized every 10 steps")
    fp4 = _strategy_line(compose_config(["strategy=diloco", "optimizer=adamw",
                                         "strategy.outer_payload_dtype=fp4_e2m1"]))
    assert fp4.endswith("; outer gradients as fp4_e2m1")
    ef = _strategy_line(compose_config(["strategy=diloco", "optimizer=adamw",
                                        "strategy.outer_payload_dtype=fp4_e2m1",
                                        "strategy.outer_error_feedback=1"]))
    assert ef.endswith("; outer gradients as fp4_e2m1 with error feedback (beta 1)")


def _observed_rounds(strategy, fragments_, observe) -> list:
    """Each round of DiLoCo (or of each Streaming DiLoCo fragment) wrapped so that
    ``observe(frag, anchor, drift, error, applied, metrics)`` adds a check after it: theta0,
    this worker's drift (float64) and error feedback (a copy, or None) before the round, the
    applied outer gradient (read back from y = theta0 - eta * delta), the round's metrics."""
    checks = []
    for frag in strategy.outer.fragments if fragments_ > 1 else [strategy.outer]:
        def checked_round(t, frag=frag, original=frag.round):
            anchor = [a.clone() for a in frag.state.anchor]
            drift = torch.cat([(a - p.detach()).double().reshape(-1)
                               for a, p in zip(anchor, frag.params)])
            error = None if frag.error is None else frag.error.double()
            strategy.comm.pop_stats()
            metrics = original(t)
            applied = torch.cat([((a - y) / 0.7).double().reshape(-1)
                                 for a, y in zip(anchor, frag.state.y_prev)])
            checks.append(observe(frag, anchor, drift, error, applied, metrics))
            return metrics

        frag.round = checked_round
    return checks


def _quantized_worker(rank, world, fragments_, gather):
    """DiLoCo with fp4 outer gradients: each round's applied delta is the workers' mean drift
    within the codec's rounding, not equal to it, and the round's bytes are the quantized
    exchange's; ``gather``: over a group without an all-to-all (its all-gather form)."""
    strategy, model = _make(fragments=fragments_, outer_payload_dtype="fp4_e2m1",
                            comm=GatherOnly() if gather else None)

    def observe(frag, anchor, drift, error, applied, metrics):
        dist.all_reduce(drift)
        drift.div_(world)
        return {"err": float((applied - drift).abs().max()), "scale": float(drift.abs().max()),
                "sent": strategy.comm.pop_stats().get("comm/outer_sent_bytes"),
                "numel": drift.numel()}

    checks = _observed_rounds(strategy, fragments_, observe)
    _steps(strategy, model, 1, 8, rank)
    return checks, torch.cat([a.reshape(-1) for a in strategy.outer.state.anchor])


@pytest.mark.parametrize("fragments_,gather", [(1, False), (2, False), (2, True)])
def test_fp4_outer_gradients_round_the_mean_and_keep_replicas_equal(fragments_, gather):
    res = run_distributed(_quantized_worker, 2, (fragments_, gather))
    assert torch.equal(res[0][1], res[1][1])   # the same theta0: every rank decodes the same bytes
    checks = res[0][0]
    assert len(checks) == 8 // (4 // fragments_)
    for c in checks:
        # e2m1 with power-of-two block scales: at most a quarter of the block maximum, twice
        # (each rank's chunk, then the mean; the all-gather form rounds once); and it did round
        assert 1e-7 < c["err"] <= (0.25 if gather else 0.5) * c["scale"] + 1e-6, c
        fp32 = ring_all_reduce_bytes(4 * c["numel"], 2)
        assert c["sent"] < fp32 / 6, (c["sent"], fp32)


def _error_feedback_worker(rank, world, fragments_, chunk):
    """fp4 outer gradients with error feedback (beta 1), ``chunk`` values per all-reduce call:
    every round, what the workers sent plus what they held back is what was applied plus what
    they hold back now, summed over the workers (nothing lost to the rounding); then the
    checkpoint carries each worker's error feedback."""
    over = dict(fragments=fragments_, outer_payload_dtype="fp4_e2m1", outer_payload_chunk=chunk,
                outer_error_feedback=1.0)
    strategy, model = _make(**over)

    def observe(frag, anchor, drift, error, applied, metrics):
        calls = strategy.comm.stats["outer"].calls
        before, after = drift + error, frag.error.double()
        for t in (before, after):
            dist.all_reduce(t)
        # applied is read back from y = theta0 - 0.7 * delta, rounded to theta0's ulp
        reach = max(float(a.abs().max()) for a in anchor) / 0.7 + float(before.abs().max())
        return {"gap": float((before - world * applied - after).abs().max()),
                "tol": 8 * world * 2 ** -23 * reach, "calls": calls, "numel": applied.numel(),
                "held": float(frag.error.abs().max()), "metric": metrics["outer/error_norm"]}

    checks = _observed_rounds(strategy, fragments_, observe)
    _steps(strategy, model, 1, 8, rank)
    fresh, _ = _make(seed=1, **over)
    fresh.load_state_dict(strategy.state_dict())
    pairs = zip(*(o.fragments if fragments_ > 1 else [o] for o in (strategy.outer, fresh.outer)))
    return checks, torch.cat([a.reshape(-1) for a in strategy.outer.state.anchor]), \
        all(torch.equal(a.error, b.error) for a, b in pairs)


@pytest.mark.parametrize("fragments_,chunk", [(1, 256), (2, 200)])
def test_fp4_outer_error_feedback_loses_nothing_and_is_checkpointed(fragments_, chunk):
    res = run_distributed(_error_feedback_worker, 2, (fragments_, chunk))
    assert torch.equal(res[0][1], res[1][1])   # replicas stay equal
    assert res[0][2] and res[1][2]             # the error feedback came back from the checkpoint
    for c in res[0][0]:
        assert c["gap"] <= c["tol"], c           # conserved, to fp32's rounding
        assert c["held"] > 0 and c["metric"] > 0, c       # and something was held back
        assert c["calls"] == 2 * -(-c["numel"] // chunk), c   # all-to-all + all-gather a chunk
        assert c["numel"] > chunk, c


def test_quantized_outer_gradients_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="applies to strategy=diloco"):
        validate(StrategyConfig(**{**CFG, "name": "sparseloco", "fragments": 1,
                                   "outer_payload_dtype": "bf16"}), OPT, 2)
    with pytest.raises(ValueError, match="set overlap_steps=0"):
        validate(StrategyConfig(**{**CFG, "overlap_steps": 1, "outer_payload_dtype": "bf16"}),
                 OPT, 2)
    with pytest.raises(ValueError, match="outer_payload_dtype must be one of"):
        validate(StrategyConfig(**{**CFG, "outer_payload_dtype": "int4"}), OPT, 2)
    with pytest.raises(ValueError, match="fp32 ones are not rounded"):
        validate(StrategyConfig(**{**CFG, "outer_error_feedback": 1.0}), OPT, 2)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        validate(StrategyConfig(**{**CFG, "outer_payload_dtype": "bf16",
                                   "outer_error_feedback": 1.5}), OPT, 2)
    with pytest.raises(ValueError, match="outer_payload_chunk must be >= 1"):
        validate(StrategyConfig(**{**CFG, "outer_payload_dtype": "bf16",
                                   "outer_payload_chunk": 0}), OPT, 2)
