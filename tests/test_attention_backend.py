"""``trainer.attention_backend``: the SDPA kernel order the trainer sets (models/attention_backend.py),
what the run reports, and what the memory plan counts for the math kernel."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

from scape_train.config import ConfigError, validate
from scape_train.models import build_model
from scape_train.models.attention_backend import (attention_backend, chosen_kernel,
                                                  parse_attention_backend, priority)
from scape_train.models.config import ModelConfig
from scape_train.plan.devices import DeviceSpec
from scape_train.plan.estimate import plan_memory
from tests.helpers import SMALL, compose_config


def test_a_choice_goes_first_and_every_other_kernel_stays_as_a_fallback():
    before = _cur_sdpa_kernel_backends(with_priority=True)
    with attention_backend("cudnn"):
        order = _cur_sdpa_kernel_backends(with_priority=True)
        assert order[:4] == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], order
    assert _cur_sdpa_kernel_backends(with_priority=True) == before       # restored
    with attention_backend("auto"):
        assert _cur_sdpa_kernel_backends(with_priority=True) == before   # untouched
    assert priority("math") == [SDPBackend.MATH]                         # exclusive
    assert priority("efficient")[0] == SDPBackend.EFFICIENT_ATTENTION and len(priority("flash")) == 4


def test_math_runs_the_unfused_kernel_with_the_same_loss_and_gradients():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                      vocab_size=64)
    assert chosen_kernel(4, 2, 8, 16, torch.device("cpu"), torch.float32) == "flash_attention"
    with attention_backend("math"):
        assert chosen_kernel(4, 2, 8, 16, torch.device("cpu"), torch.float32) == "math"
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=64)
    other = copy.deepcopy(model)
    x = torch.randint(64, (2, 16))
    losses, grads = [], []
    for m, name in ((model, "auto"), (other, "math")):
        with attention_backend(name):
            loss = m(x, targets=x)
            loss.backward()
        losses.append(loss.item())
        grads.append([p.grad for p in m.parameters()])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_config_takes_the_choices_and_refuses_others():
    for value in ("auto", "cudnn", "flash", "efficient", "math", "CUDNN"):
        validate(compose_config([f"trainer.attention_backend={value}"]))
    assert parse_attention_backend(" Flash ") == "flash"
    with pytest.raises(ConfigError, match="attention_backend must be auto|cudnn"):
        validate(compose_config(["trainer.attention_backend=flash3"]))


def test_the_memory_plan_counts_the_math_kernels_scores_on_a_gpu():
    gpu = DeviceSpec("big", "gpu", 1 << 50)
    peaks = {}
    for name in ("auto", "math"):
        cfg = compose_config(SMALL + ["trainer.precision=bf16", f"trainer.attention_backend={name}"])
        traced = plan_memory(cfg, 1, gpu, trace=True)
        bound = plan_memory(cfg, 1, gpu, trace=False)
        assert all(b >= t for b, t in zip(bound.totals(), traced.totals())), name
        peaks[name] = traced.peak
    b, h, t = 4, 4, 64                       # SMALL: micro-batch 4, 4 heads, sequence 64
    assert peaks["math"] - peaks["auto"] >= 2 * b * h * t * t * 2      # >= 2 layers' bf16 scores


def test_the_trainer_trains_under_the_order_and_reports_the_kernel(tmp_path_factory, capsys):
    from scape_train.train import Trainer
    from tests import _fault_job as fj

    before = _cur_sdpa_kernel_backends(with_priority=True)
    root = tmp_path_factory.mktemp("math")
    cfg = compose_config(SMALL + [f"run_dir={root}/run", "trainer.sample_tokens=0",
                                  f"data.tokenizer.cache_dir={fj.tok_cache(tmp_path_factory)}",
                                  "trainer.max_steps=2", "trainer.attention_backend=math"])
    summary = Trainer(cfg).fit()
    assert summary["step"] == 2
    assert "attention   math (trainer.attention_backend=math)" in capsys.readouterr().out
    assert _cur_sdpa_kernel_backends(with_priority=True) == before     # restored
