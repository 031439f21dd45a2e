"""AdamS (spec §1) against an independent float64 transcription of the equations."""

import math

import pytest
import torch

from scape_train.optim.adams import AdamS


def reference_adams(theta, grads, lr, b1, b2, eps, wd, variant):
    """Spec §1 element by element in float64 (independent of the implementation's op order)."""
    theta = [float(v) for v in theta]
    m = [0.0] * len(theta)
    for t, g in enumerate(grads, start=1):
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        for i, gi in enumerate(g.tolist()):
            prev = m[i] / bc1 if variant == "official" else m[i]
            v = b2 * prev ** 2 + (1 - b2) * gi ** 2
            m[i] = b1 * m[i] + (1 - b1) * gi
            theta[i] *= 1 - lr * wd
            if variant == "adam":
                theta[i] -= (lr / bc1) * m[i] / (math.sqrt(v) / math.sqrt(bc2) + eps)
            elif variant == "official":
                theta[i] -= lr * (m[i] / bc1) / (math.sqrt(v) + eps)
            else:
                theta[i] -= lr * m[i] / (math.sqrt(v) + eps)
    return torch.tensor(theta, dtype=torch.float64)


@pytest.mark.parametrize("variant", ["adam", "official", "none"])
def test_matches_reference(variant):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(torch.randn(4))
    grads_w = [torch.randn(5, 4) for _ in range(6)]
    grads_b = [torch.randn(4) for _ in range(6)]
    ref_w = reference_adams(w.detach().reshape(-1), [g.reshape(-1) for g in grads_w],
                            3e-2, 0.9, 0.95, 1e-8, 0.1, variant)
    ref_b = reference_adams(b.detach(), grads_b, 3e-2, 0.9, 0.95, 1e-8, 0.0, variant)
    opt = AdamS([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
                lr=3e-2, bias_correction=variant)
    for gw, gb in zip(grads_w, grads_b):
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    torch.testing.assert_close(w.detach().reshape(-1).double(), ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.detach().double(), ref_b, rtol=1e-5, atol=1e-6)


def test_first_step_is_lr_sign():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(1000))
    start = p.detach().clone()
    g = torch.randn(1000)
    opt = AdamS([p], lr=0.01, weight_decay=0.0)
    p.grad = g
    opt.step()
    step = p.detach() - start
    torch.testing.assert_close(step, -0.01 * torch.sign(g), rtol=0, atol=1e-6)


def test_state_is_one_tensor_and_step():
    p = torch.nn.Parameter(torch.randn(3, 3))
    opt = AdamS([p])
    p.grad = torch.randn(3, 3)
    opt.step()
    state = opt.state_dict()["state"][0]
    assert set(state) == {"exp_avg", "step"} and state["step"] == 1
    assert state["exp_avg"].shape == p.shape


def test_weight_decay_is_decoupled_and_zero_grad_moves_nothing_but_decay():
    p = torch.nn.Parameter(torch.ones(4, 4))
    opt = AdamS([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(4, 4)
    opt.step()
    # m stays 0, so only the decay acts: θ(1 - lr·wd)
    torch.testing.assert_close(p.detach(), torch.full((4, 4), 0.95))


@pytest.mark.parametrize("kwargs", [dict(betas=(1.0, 0.9)), dict(lr=-1.0), dict(eps=-1.0),
                                    dict(bias_correction="bogus"), dict(weight_decay=-0.1)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        AdamS([torch.nn.Parameter(torch.zeros(2))], **kwargs)
