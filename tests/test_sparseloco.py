"""SparseLoCo on real gloo processes: its round against the rule in float64 (error feedback,
top-k of every chunk, the gathered mean, the outer step), its bytes, the codec's rounding kept in
the error feedback, exact resume through the strategy, and the refusals."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from scape_train.comm import Comm, ring_all_gather_bytes
from scape_train.optim.local import StrategyConfig, validate
from scape_train.optim.local.config import ElasticConfig
from scape_train.optim.local.sparseloco import SparseLoCo
from tests._dist import run_distributed
from tests._optim_common import flat_params
from tests.test_gasloc import OPT, SHAPES, NUMEL, _flat, _initial, _make, _noise, _steps

CHUNK, TOPK = 8, 2          # 36 values: 5 chunks, the last one padded


def _reference(n: int, rounds: int, eta: float, gamma: float, beta: float):
    """Every worker's flat parameters and error feedback after each round, in float64."""
    chunks = -(-NUMEL // CHUNK)
    theta0 = _flat(_initial()).double()
    errors = [torch.zeros(chunks * CHUNK, dtype=torch.float64) for _ in range(n)]
    b, out = None, []
    for t in range(rounds):
        sent = []
        for r in range(n):
            e = errors[r]
            e[:NUMEL] = beta * e[:NUMEL] - _flat(_noise(r, t)).double()   # drift = theta0 - theta
            rows = e.view(chunks, CHUNK)
            index = rows.abs().topk(TOPK, dim=1).indices
            s = torch.zeros_like(rows).scatter_(1, index, rows.gather(1, index))
            rows -= s
            sent.append(s.reshape(-1)[:NUMEL])
        delta = sum(sent) / n
        b = delta if b is None else gamma * b + delta
        theta0 = theta0 - eta * (delta + gamma * b)
        out.append((theta0.clone(), [e.clone() for e in errors]))
    return out


def _round_worker(rank, world, rounds, eta, gamma, beta, payload):
    params = [nn.Parameter(t) for t in _initial()]
    comm = Comm()
    outer = SparseLoCo(params, [f"p{i}" for i in range(len(params))], comm, eta, gamma, False,
                       chunk=CHUNK, topk=TOPK, error_decay=beta, payload_dtype=payload)
    messages = []
    compress = outer.compress

    def keep_message(keep_local=False):
        out = compress(keep_local)
        messages.append(out[0].clone())
        return out

    outer.compress = keep_message
    history, kept = [], []
    for t in range(rounds):
        with torch.no_grad():
            for p, d in zip(params, _noise(rank, t)):
                p.add_(d)
        comm.pop_stats()
        before = outer.error.clone()
        before[:NUMEL].mul_(beta).add_(outer.drift_flat())    # compress's own ops, in fp32
        metrics = outer.round(t)
        # this worker's own list, as the others decode it: it left the error feedback exactly
        # (e_after + s == e_before bit for bit: nothing is lost to the codec's rounding)
        m, v = messages[-1], outer.value_bytes
        index = m[v:v + 2 * outer.sent].view(torch.int16).view(outer.chunks, TOPK)
        values = outer.codec.decode(m[:outer.codec.nbytes(outer.sent)].view(1, -1), outer.sent)
        sent = torch.zeros(outer.chunks, CHUNK).scatter_(1, index.long(),
                                                         values.view(outer.chunks, TOPK))
        kept.append(torch.equal(outer.error + sent.view(-1), before)
                    and int((sent != 0).sum()) == outer.sent)
        history.append((_flat(params).detach().clone(), outer.error.clone(),
                        comm.pop_stats(), metrics))
    return history, kept, outer.message_bytes


@pytest.mark.parametrize("eta,gamma", [(1.0, 0.0), pytest.param(0.7, 0.9, marks=pytest.mark.slow)],
                         ids=["paper", "nesterov"])
def test_sparseloco_follows_its_rule_and_counts_its_bytes(eta, gamma):
    n, rounds, beta = 3, 4, 0.95
    res = run_distributed(_round_worker, n, (rounds, eta, gamma, beta, "fp32"))
    ref = _reference(n, rounds, eta, gamma, beta)
    chunks = -(-NUMEL // CHUNK)
    for rank, (history, kept, message_bytes) in enumerate(res):
        assert message_bytes == chunks * TOPK * (2 + 4)       # int16 positions + fp32 values
        for t, (theta, error, stats, metrics) in enumerate(history):
            torch.testing.assert_close(theta.double(), ref[t][0], rtol=0, atol=1e-5)
            torch.testing.assert_close(error.double(), ref[t][1][rank], rtol=0, atol=1e-5)
            assert torch.equal(theta, res[0][0][t][0])         # replicas stay identical
            assert stats["comm/outer_sent_bytes"] == ring_all_gather_bytes(message_bytes, n)
            assert metrics["outer/committed"] == 1.0 and metrics["outer/error_norm"] > 0
        assert all(kept)


def test_an_fp8_payload_keeps_its_rounding_in_the_error_feedback():
    res = run_distributed(_round_worker, 2, (3, 1.0, 0.0, 0.95, "fp8_e4m3"))
    ref = _reference(2, 3, 1.0, 0.0, 0.95)
    for history, kept, message_bytes in res:
        assert all(kept)                                      # e_after + sent == e_before exactly
        assert message_bytes == 12 + 20       # 10 fp8 values and a scale byte, 10 int16 positions
        theta = history[-1][0].double()
        assert not torch.allclose(theta, ref[-1][0], rtol=0, atol=1e-6)   # fp8 rounded
        torch.testing.assert_close(theta, ref[-1][0], rtol=0, atol=2e-2)
    assert torch.equal(res[0][0][-1][0], res[1][0][-1][0])


def _resume_worker(rank, world, overlap):
    cfg = StrategyConfig(name="sparseloco", inner_steps=3, outer_lr=1.0, outer_momentum=0.0,
                         sparse_chunk=16, sparse_topk=3, overlap_steps=overlap,
                         overlap_merge="carry" if overlap else "mix")
    straight, m1 = _make(cfg, 0)
    log = _steps(straight, m1, 1, 12, rank)
    first, m2 = _make(cfg, 0)
    _steps(first, m2, 1, 7, rank)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    _steps(first, m2, 8, 9, rank)           # keeps running: the saved state must not change
    second, m3 = _make(cfg, 123)
    buf.seek(0)
    second.load_state_dict(torch.load(buf, weights_only=True))
    _steps(second, m3, 8, 12, rank)
    return {"agreed": [m["progress"] for m in log if m["progress"] is not None],
            "equal": torch.equal(flat_params(m1), flat_params(m3)),
            "error_equal": torch.equal(straight.outer.error, second.outer.error),
            "anchor": torch.cat([a.reshape(-1) for a in straight.outer.state.anchor])}


@pytest.mark.parametrize("overlap", [0, 1], ids=["blocking", "overlap_carry"])
def test_sparseloco_resumes_exactly_with_its_error_feedback(overlap):
    res = run_distributed(_resume_worker, 2, (overlap,))
    for r in res:
        assert r["agreed"] == [3, 6, 9, 12]
        assert r["equal"] and r["error_equal"]
    # the outer point is the same on every worker (theta too, where no round is in flight)
    assert torch.equal(res[0]["anchor"], res[1]["anchor"])


@pytest.mark.parametrize("overrides,words", [
    (dict(sparse_topk=0), "sparse_topk"),
    (dict(sparse_topk=65, sparse_chunk=64), "sparse_topk <= sparse_chunk"),
    (dict(sparse_chunk=65536, sparse_topk=64), "32768"),
    (dict(sparse_error_decay=1.5), "sparse_error_decay"),
    (dict(sparse_payload_dtype="int2"), "sparse_payload_dtype"),
    (dict(topology="2peer"), "topology must be complete"),
])
def test_bad_sparseloco_configs_are_refused_by_name(overrides, words):
    cfg = StrategyConfig(name="sparseloco", **overrides)
    with pytest.raises(ValueError, match=words):
        validate(cfg, OPT, 1)


def test_the_shipped_sparseloco_config_composes_and_validates():
    from tests.helpers import compose_config

    cfg = compose_config(["strategy=sparseloco", "optimizer=adamw"])
    validate(cfg.strategy, cfg.optimizer, 4)
    s = cfg.strategy
    assert (s.name, s.outer_lr, s.outer_momentum, s.sparse_chunk, s.sparse_topk) == \
        ("sparseloco", 1.0, 0.0, 4096, 64)
