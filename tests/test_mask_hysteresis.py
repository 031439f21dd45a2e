"""``optimizer.mask_hysteresis`` (ours, opt-in, not in the spec): the next mask is the per-segment
top-k of ``|c|·(1+γ)`` on M_t and ``|c|`` elsewhere; everything else is SCAPE's step."""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.config import OptimizerConfig
from scape_train.optim.scape.masks import segment_k

from ._optim_common import make, train_step
from .test_scape_fused import _compare, _pair_run


def _cfg(**kw) -> OptimizerConfig:
    base = dict(name="scape", lr=1e-2, density=0.05, density_warmup_steps=0, clip_grad=0.05,
                scape_impl="reference")
    base.update(kw)
    return OptimizerConfig(**base)


def _expected_next(c: torch.Tensor, cur: torch.Tensor, gamma: float, s) -> torch.Tensor:
    stat = c.abs() * torch.where(cur, 1.0 + gamma, 1.0)
    out = torch.zeros_like(cur)
    for seg in s.part.segments[0]:
        a, n = seg.flat_start, seg.numel
        k = segment_k(n, s.cfg.density)
        if s.layout.excluded[seg.tensor] or k >= n:
            out[a:a + n] = True
        else:
            out[a + torch.topk(stat[a:a + n], k).indices] = True
    return out


def test_the_next_mask_is_the_top_k_of_the_boosted_statistic():
    gamma = 2.0
    s, w, _ = make(_cfg(mask_hysteresis=gamma))
    s.keep_intermediates()
    boosted = []
    for t in range(1, 6):
        train_step(s, w, t, 0)
        c, cur, nxt = s.last_engine.last["c"], s.mask_cur, s.next_mask()
        assert torch.equal(nxt, _expected_next(c, cur, gamma, s)), t
        boosted.append(not torch.equal(nxt, _expected_next(c, cur, 0.0, s)))
    s.close()
    assert any(boosted)     # the boost decided: the spec's statistic picks another mask


def test_a_stronger_hysteresis_keeps_more_of_the_mask():
    overlaps = {}
    for gamma in (0.0, 2.0):
        s, w, _ = make(_cfg(mask_hysteresis=gamma))
        got = [train_step(s, w, t, 0).get("scape/mask_overlap") for t in range(1, 8)]
        overlaps[gamma] = sum(got[2:]) / len(got[2:])     # M_2 is M_1 here: from step 3
        s.close()
    assert overlaps[2.0] > overlaps[0.0] + 0.02, overlaps


@pytest.mark.parametrize("sharded", [False, True])
def test_the_fused_step_equals_the_reference_with_hysteresis(sharded):
    _compare(_pair_run(0, mask_hysteresis=1.0, sharded=sharded))


def test_a_negative_hysteresis_is_refused():
    from scape_train.optim import validate
    with pytest.raises(ValueError, match="mask_hysteresis"):
        validate(OptimizerConfig(name="scape", mask_hysteresis=-1.0))
