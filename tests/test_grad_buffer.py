"""SCAPE's flat gradient buffer (``optimizer.flat_grads``): ``p.grad`` are views of one tensor,
backward accumulates into it in place, and the step reads it without a copy -- with the same
results as autograd's own per-parameter gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scape_train.optim.config import OptimizerConfig
from scape_train.optim.grad_buffer import write_grads
from scape_train.plan.estimate import _rows
from scape_train.plan.optimizer_memory import OptimizerMemory
from scape_train.plan.trace import MicroBatchTrace

from ._optim_common import batch, flat_params, loss_fn, make, train_step


def scape(**kw) -> OptimizerConfig:
    return OptimizerConfig(name="scape", density=0.2, clip_grad=1.0, **kw)


def test_grads_are_views_of_one_buffer_through_backward_and_zero_grad():
    strategy, wrapped, model = make(scape())
    buf = strategy.grad_buffer
    params = list(model.parameters())
    for _ in range(2):                                   # zero_grad keeps them attached
        x, y = batch(1, 0)
        for xs, ys in zip(x.chunk(2), y.chunk(2)):       # two micro-batches accumulate
            (loss_fn(wrapped, xs, ys) / 2).backward()
        assert all(p.grad is v for p, v in zip(params, buf.views))
        assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), buf.buffer)
        assert bool(buf.buffer.any())
        strategy.zero_grad()
        assert all(p.grad is v for p, v in zip(params, buf.views))
        assert not bool(buf.buffer.any())


@pytest.mark.parametrize("micro", [1, 2])
def test_accumulated_gradients_equal_autograds_own(micro):
    """The buffer starts at zero and adds each micro-batch; autograd's own tensors take the
    first micro-batch's gradient as it is: 0 + g is g, so the sums are bit-identical."""
    grads = []
    for flat in (True, False):
        strategy, wrapped, model = make(scape(flat_grads=flat))
        x, y = batch(3, 0, 8 * micro)
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(wrapped, xs, ys) / micro).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_training_with_the_buffer_equals_training_without(impl, sharded):
    """Bit for bit over a density warm-up (its dense start takes the reference step, then the
    fused one), two micro-batches per step."""
    runs = []
    for flat in (True, False):
        strategy, wrapped, model = make(scape(flat_grads=flat, scape_impl=impl, sharded=sharded,
                                              density_warmup_steps=3))
        for step in range(1, 7):
            train_step(strategy, wrapped, step, 0, micro=2)
        runs.append((flat_params(model), strategy.reference.state.m.clone(), strategy.mask_cur.clone()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


class _FullSizeCats(TorchDispatchMode):
    """Counts the ``cat``s whose output has ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.cat and out.numel() == self.numel:
            self.count += 1
        return out


@pytest.mark.parametrize("flat", [True, False])
def test_the_reference_step_reads_the_buffer_without_a_copy(flat):
    strategy, wrapped, _ = make(scape(flat_grads=flat, scape_impl="reference"))
    strategy.before_forward(1)
    loss_fn(wrapped, *batch(1, 0)).backward()
    with _FullSizeCats(strategy.layout.total) as cats:
        strategy.step(1e-2)
    # without the buffer the reference path concatenates the gradients: one full-size cat
    assert cats.count == (0 if flat else 1)
    if flat:
        assert strategy._flat_grads() is strategy.grad_buffer.buffer


def test_the_prepare_reads_the_buffer_as_one_range():
    """The flat buffer is one range for the Triton prepare (one contiguous, aligned tensor):
    ``passes.flat_buffer`` finds it behind the per-tensor views; autograd's tensors are not."""
    from scape_train.optim.scape.passes import flat_buffer

    for flat in (True, False):
        strategy, wrapped, model = make(scape(flat_grads=flat))
        loss_fn(wrapped, *batch(1, 0)).backward()
        buf = flat_buffer(strategy._grads(), strategy.layout.offsets)
        if flat:
            assert buf.numel() == strategy.layout.total and buf.is_contiguous()
            assert buf.data_ptr() == strategy.grad_buffer.buffer.data_ptr()
        else:
            assert buf is None


def test_gradients_set_by_hand_are_copied_in_once_warned():
    strategy, wrapped, model = make(scape())
    other, other_wrapped, other_model = make(scape(flat_grads=False))
    for s, w in ((strategy, wrapped), (other, other_wrapped)):
        loss_fn(w, *batch(1, 0)).backward()
        s.step(1e-2)
        s.zero_grad()
    model.zero_grad(set_to_none=True)                    # detaches every view
    params = list(model.parameters())
    g = [torch.randn_like(p) for p in params]
    for p, gi in zip(params, g):
        p.grad = gi.clone()
    write_grads(list(other_model.parameters()), [gi.clone() for gi in g])
    with pytest.warns(UserWarning, match="flat gradient buffer"):
        strategy.step(1e-2)
    other.step(1e-2)
    assert all(p.grad is v for p, v in zip(params, strategy.grad_buffer.views))
    assert torch.equal(flat_params(model), flat_params(other_model))


def test_gradients_written_into_the_views_count_as_given():
    strategy, _, model = make(scape())
    params = list(model.parameters())
    write_grads(params, [torch.randn_like(p) for p in params], strategy.grad_buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.step(1e-2)


def test_a_parameter_outside_the_loss_is_named_even_after_a_step():
    strategy, wrapped, model = make(scape())
    train_step(strategy, wrapped, 1, 0)                  # a full step, then one layer only
    model[0](torch.randn(2, 12)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'1\.weight' has no gradient"):
        strategy.step(1e-2)


def test_the_memory_plan_holds_the_buffer_through_the_forward():
    fb = MicroBatchTrace(params=400, grads=400, peak=0, peak_grads=100, peak_activations=1000,
                         peak_logits=10, peak_backward=10, held_after=0, ops=0)
    for persistent, at_peak in ((True, 400 + 40), (False, 100)):
        opt = OptimizerMemory(grads_persistent=persistent, grads_transient=40 * persistent)
        rows = _rows(400, opt, fb, bf16=False)
        (grads,) = [r for r in rows if r.name.startswith("gradients")]
        assert grads.cells[:2] == (at_peak, 400)
