"""The chunked linear cross-entropy (models/loss.py) against F.cross_entropy over the full logits:
the same loss and gradients (hidden states, head weight), and only one chunk of logits alive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scape_train.models import build_model
from scape_train.models.config import ModelConfig
from scape_train.models.loss import IGNORE_INDEX, linear_cross_entropy
from scape_train.plan.tracker import LiveBytes


def _inputs(n=300, d=32, vocab=200, padded=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = (torch.randn(padded, d, generator=g) * 0.3).requires_grad_()
    t = torch.randint(vocab, (n,), generator=g)
    return h, w, t


def _reference(h, w, t, vocab):
    """Today's loss, written out: the sliced logits' mean cross-entropy in fp32."""
    return F.cross_entropy(F.linear(h, w)[:, :vocab].float(), t)


def _loss_and_grads(fn, h, w, t):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, t)
    (loss * 0.5).backward()        # a grad_output other than 1, as gradient accumulation gives
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [64, 100, 299])
def test_fp32_equals_the_full_logits_to_1e_5(chunk):
    h, w, t = _inputs()
    t[::7] = IGNORE_INDEX          # ignored targets leave the mean, as in F.cross_entropy
    ref = _loss_and_grads(lambda h, w, t: _reference(h, w, t, 200), h, w, t)
    got = _loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, 200, chunk), h, w, t)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_equals_the_full_logits_within_bf16_tolerance():
    h, w, t = _inputs(n=512, d=64)

    def under_autocast(fn):
        def run(h, w, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w, t)
        return run

    ref = _loss_and_grads(under_autocast(lambda h, w, t: _reference(h, w, t, 200)), h, w, t)
    got = _loss_and_grads(under_autocast(lambda h, w, t: linear_cross_entropy(h, w, t, 200, 128)),
                          h, w, t)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(got[1:], ref[1:]):      # bf16 logits and gradient GEMMs: 8 mantissa bits
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_without_grad_it_only_computes_the_loss():
    h, w, t = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, 200, 64)
        ref = _reference(h, w, t, 200)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_models_train_on_it_with_the_same_gradients(arch):
    """GPT's head is its token embedding (tied): both uses add into one gradient."""
    cfg = ModelConfig(arch=arch, n_layers=2, d_model=32, n_heads=4, max_seq_len=32,
                      vocab_size=90, vocab_pad_multiple=64, tie_embeddings=arch == "gpt",
                      bias=arch == "gpt")
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=90)
    x, y = torch.randint(90, (3, 32)), torch.randint(90, (3, 32))
    results = []
    for chunk in (0, 40):
        model.zero_grad()
        model.loss_chunk_tokens = chunk
        loss = model(x, targets=y)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_only_one_chunk_of_logits_is_ever_alive():
    """Peak live bytes of forward + backward: the full path holds B*T x V logits and their fp32
    copy and gradient; the chunked one a chunk's worth, independent of the token count."""
    vocab, d = 4096, 32

    def peak(n, chunk):
        h, w, t = _inputs(n=n, d=d, vocab=vocab, padded=vocab)
        tracker = LiveBytes()
        with tracker:
            linear_cross_entropy(h, w, t, vocab, chunk).backward()
        return tracker.peak

    logits_bytes = 2048 * vocab * 4
    full = peak(2048, 0)
    chunked = peak(2048, 256)
    assert full > 2 * logits_bytes                      # logits, their softmax/gradient
    assert chunked < logits_bytes / 2
    assert peak(4096, 256) - chunked < logits_bytes / 4    # grows with h, not with the logits
