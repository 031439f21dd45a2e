"""Activation checkpointing policies (models/checkpointing.py), the trainer's compile setting
(models/training.py) and ``activation_checkpointing=auto`` in the memory plan."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from scape_train import distributed as D
from scape_train.config import ConfigError, validate
from scape_train.models import build_model
from scape_train.models.checkpointing import (LADDER, block_policies, parse_policy, policy_of,
                                              stronger_than)
from scape_train.models.config import ModelConfig
from scape_train.models.training import compile_enabled, parse_compile, prepare_for_training
from scape_train.plan.check import resolve_checkpointing
from scape_train.plan.devices import DeviceSpec
from scape_train.plan.estimate import choose_checkpointing, plan_memory, with_checkpointing
from tests.helpers import SMALL, compose_config


def _train(model, batches, lr=1e-2):
    """Two plain SGD steps in fp32; the losses and the gradients of the last step."""
    losses = []
    for x, y in batches:
        model.zero_grad()
        loss = model(x, targets=y)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses, grads


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("policy", ["full", "selective", "full_every_2"])
def test_each_policy_gives_the_loss_and_gradients_of_no_checkpointing(arch, policy):
    cfg = ModelConfig(arch=arch, n_layers=3, d_model=32, n_heads=4,
                      n_kv_heads=2 if arch == "llama" else 0, ffn_dim=64, max_seq_len=16,
                      vocab_size=64, tie_embeddings=arch == "gpt", bias=arch == "gpt")
    torch.manual_seed(0)
    plain = build_model(cfg, vocab_size=64)
    recomputed = copy.deepcopy(plain)
    prepare_for_training(recomputed, policy, compile=False, loss_chunk_tokens=0)
    assert policy_of(recomputed) == policy and policy_of(plain) == "none"
    # parameter names (checkpoints, optimizers, Hugging Face export) are unchanged
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(64, (2, 16), generator=g), torch.randint(64, (2, 16), generator=g))
               for _ in range(2)]
    ref_losses, ref_grads = _train(plain, batches)
    losses, grads = _train(recomputed, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # inference (no grad, or a KV cache) runs the plain forward
    with torch.no_grad():
        torch.testing.assert_close(recomputed(batches[0][0]), plain(batches[0][0]))


def test_a_policy_replaces_the_previous_one_and_none_restores_the_class():
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64), vocab_size=64)
    cls = type(model.layers[0])
    for policy in ("full", "selective", "none"):
        prepare_for_training(model, policy, compile=False, loss_chunk_tokens=0)
        assert policy_of(model) == policy
        assert isinstance(model.layers[0], cls)
    assert type(model.layers[0]) is cls
    # every block shares one class per policy: compiled, their code is the same
    prepare_for_training(model, "selective", compile=False, loss_chunk_tokens=0)
    assert len({type(b) for b in model.layers}) == 1


def test_mixed_policies_put_every_nth_block_in_full_and_the_rest_selective():
    assert block_policies("full_every_2", 5) == ["full", "selective"] * 2 + ["full"]
    assert block_policies("full_every_4", 3) == ["full", "selective", "selective"]
    assert block_policies("selective", 2) == ["selective"] * 2
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64), vocab_size=64)
    prepare_for_training(model, "full_every_2", compile=False, loss_chunk_tokens=0)
    assert policy_of(model) == "full_every_2"
    assert len({type(b) for b in model.layers}) == 2          # one class per block policy
    prepare_for_training(model, "full_every_4", compile=False, loss_chunk_tokens=0)
    assert policy_of(model) == "full_every_4"
    # in recompute order: what auto walks, and what the plan's fixes try after a given policy
    assert LADDER == ("none", "selective", "full_every_4", "full_every_2", "full")
    assert stronger_than("selective") == ["full_every_4", "full_every_2", "full"]
    assert stronger_than("full_every_3") == ["full_every_2", "full"]
    assert stronger_than("full") == [] and stronger_than("auto") == list(LADDER[1:])


def test_selective_keeps_less_than_none_and_more_than_full():
    """The plan traces each policy's saved activations (two Llama-500M blocks, fake tensors)."""
    cfg = compose_config(["+experiment=llama500m_s99", "trainer.global_batch_size=0",
                          "model.n_layers=2", "model.vocab_size=256", "trainer.micro_batch_size=1",
                          "data.seq_len=1024"])
    spec = DeviceSpec("big", "gpu", 1 << 50)
    act = {p: plan_memory(with_checkpointing(cfg, p), 1, spec, trace=True).rows
           for p in ("none", "selective", "full")}
    saved = {p: next(r.cells[0] for r in rows if r.name.startswith("activations"))
             for p, rows in act.items()}
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["selective"] < 0.6 * saved["none"]     # the [B, T, ffn] elementwise tensors


@pytest.mark.parametrize("value, policy", [("none", "none"), ("full", "full"),
                                           ("selective", "selective"), ("auto", "auto"),
                                           ("true", "full"), ("false", "none"),
                                           ("True", "full"), (False, "none"), (True, "full"),
                                           ("full_every_2", "full_every_2"),
                                           ("FULL_EVERY_03", "full_every_3")])
def test_policy_values_accepted(value, policy):
    assert parse_policy(value) == policy


def test_config_accepts_the_policies_and_compile_values_and_refuses_others():
    for value in ("none", "selective", "full", "full_every_4", "auto", "true", "false"):
        validate(compose_config([f"trainer.activation_checkpointing={value}"]))
    for value in ("full_every_1", "full_every_0", "full_every_", "every_2"):
        with pytest.raises(ConfigError, match="full_every_N"):
            validate(compose_config([f"trainer.activation_checkpointing={value}"]))
    for value in ("auto", "true", "false"):
        validate(compose_config([f"trainer.compile={value}"]))
    with pytest.raises(ConfigError, match="activation_checkpointing must be none|selective|full"):
        validate(compose_config(["trainer.activation_checkpointing=some"]))
    with pytest.raises(ConfigError, match="trainer.compile must be auto|true|false"):
        validate(compose_config(["trainer.compile=maybe"]))
    with pytest.raises(ConfigError, match="loss_chunk_tokens must be >= 0"):
        validate(compose_config(["trainer.loss_chunk_tokens=-1"]))
    assert compose_config([]).trainer.compile == "auto"


def test_compile_auto_is_cuda_only():
    assert parse_compile("True") == "true"
    assert compile_enabled("auto", "cuda") and not compile_enabled("auto", "cpu")
    assert compile_enabled("true", "cpu") and not compile_enabled("false", "cuda")


def test_auto_picks_the_least_recompute_that_fits():
    cfg = compose_config(SMALL + ["trainer.activation_checkpointing=auto",
                                  "trainer.micro_batch_size=64", "model.n_layers=4"])
    gpu = lambda capacity: DeviceSpec("test", "gpu", capacity)   # noqa: E731
    peaks = {p: plan_memory(with_checkpointing(cfg, p), 1, gpu(1 << 50), trace=True).peak
             for p in LADDER}
    assert [peaks[p] for p in LADDER] == sorted(peaks.values(), reverse=True)
    assert len(set(peaks.values())) == len(LADDER), peaks
    reserve, margin = gpu(0).reserve, 1 - gpu(0).fragmentation

    def capacity_for(peak):        # the smallest device whose usable memory holds ``peak``
        return int(peak / margin) + reserve + 1

    for capacity, expected in ((capacity_for(peaks[p]), p) for p in LADDER):
        plan = choose_checkpointing(cfg, 1, gpu(capacity), trace=True)
        assert plan.activation_checkpointing == expected and plan.fits
        assert f"activation checkpointing auto: {expected}" in plan.notes[-1]
    plan = choose_checkpointing(cfg, 1, gpu(capacity_for(peaks["full"]) - (1 << 10)), trace=True)
    assert plan.activation_checkpointing == "full" and not plan.fits


def test_the_trainer_resolves_auto_before_its_memory_check():
    cfg = compose_config(SMALL + ["trainer.activation_checkpointing=auto", "plan.device=h100-80gb"])
    assert resolve_checkpointing(cfg, D.DistInfo()).trainer.activation_checkpointing == "none"
    legacy = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer,
                                                                  activation_checkpointing="True"))
    assert resolve_checkpointing(legacy, D.DistInfo()).trainer.activation_checkpointing == "full"


@pytest.mark.slow
@pytest.mark.parametrize("policy, graphs", [("full", 1), ("selective", 1), ("full_every_2", 2)])
def test_compiled_checkpointed_blocks_share_one_graph_and_match_eager(policy, graphs):
    """Compile outside the checkpoint, block by block: one graph serves every block of a policy
    (one compile, not one per layer), no graph break, and bf16 gradients as eager's."""
    from torch._dynamo.utils import counters

    cfg = ModelConfig(n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128,
                      max_seq_len=64, vocab_size=100, vocab_pad_multiple=64)
    torch.manual_seed(0)
    eager = build_model(cfg, vocab_size=100)
    compiled = copy.deepcopy(eager)
    prepare_for_training(compiled, policy, compile=True, loss_chunk_tokens=0)
    x, y = torch.randint(100, (2, 64)), torch.randint(100, (2, 64))

    def grads(model):
        for _ in range(2):             # the second step reuses the compiled graphs
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, targets=y)
            loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    counters.clear()
    loss, got = grads(compiled)
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    ref_loss, ref = grads(eager)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()
