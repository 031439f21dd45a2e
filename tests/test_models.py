"""The in-tree GPT and Llama models: shapes, causality, GQA, padding, init, counting, validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from scape_train.models import ModelConfig, build_model, resolve_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"


def load_yaml(name: str) -> ModelConfig:
    # Merging into the structured schema rejects unknown keys and wrong types.
    schema = OmegaConf.structured(ModelConfig)
    merged = OmegaConf.merge(schema, OmegaConf.load(CONFIG_DIR / f"{name}.yaml"))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def tiny(arch: str = "llama", **kw) -> ModelConfig:
    base = dict(arch=arch, n_layers=2, d_model=64, n_heads=4, max_seq_len=32, vocab_size=100)
    if arch == "gpt":
        base.update(tie_embeddings=True, bias=True)
    else:
        base.update(n_kv_heads=2)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize(
    "name,vocab,expected",
    [
        ("gpt345m", 50257, 354_823_168),
        ("llama500m", 32000, 513_590_784),
        ("llama1_8b", 32000, 1_831_201_280),
    ],
)
def test_paper_configs_have_the_papers_parameter_counts(name, vocab, expected):
    cfg = load_yaml(name)
    model = build_model(cfg, vocab_size=vocab, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == expected
    assert model.cfg.vocab_size == vocab and model.vocab_size == vocab


NAMED = ["llama_tiny", "gpt_tiny", "llama_20m", "gpt345m", "llama500m", "llama1_8b"]


@pytest.mark.parametrize("name", NAMED)
def test_yaml_files_set_every_field_and_build(name):
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{name}.yaml"))
    assert set(raw) == {f.name for f in dataclasses.fields(ModelConfig)}
    assert raw["vocab_size"] == 0 and raw["name"] == name
    build_model(load_yaml(name), vocab_size=8192, device="meta")


def test_cpu_config_sizes():
    assert 15e6 <= build_model(load_yaml("llama_20m"), 8192, device="meta").num_params() <= 20e6
    for name in ("llama_tiny", "gpt_tiny"):
        m = build_model(load_yaml(name), 8192, device="meta")
        assert 2e6 <= sum(p.numel() for p in m.layers.parameters()) <= 4e6


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_forward_shape_and_backward(arch):
    torch.manual_seed(0)
    model = build_model(tiny(arch))
    ids = torch.randint(0, 100, (3, 17))
    logits = model(ids)
    assert logits.shape == (3, 17, 100) and logits.dtype == torch.float32
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_causal(arch):
    torch.manual_seed(0)
    model = build_model(tiny(arch)).eval()
    ids = torch.randint(0, 100, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (ids[:, 12] + 1) % 100
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gqa_equals_attention_with_repeated_kv_heads():
    """A GQA model equals a full multi-head model whose K/V heads are repeated per group."""
    torch.manual_seed(0)
    gqa = build_model(tiny("llama", n_heads=8, n_kv_heads=2)).eval()
    mha = build_model(tiny("llama", n_heads=8, n_kv_heads=8)).eval()
    head_dim, group = 64 // 8, 4
    state = gqa.state_dict()
    for key, t in list(state.items()):
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):
            # Query heads 4j..4j+3 share K/V head j (consecutive groups, as in HF's repeat_kv).
            state[key] = t.view(2, head_dim, 64).repeat_interleave(group, dim=0).reshape(64, 64)
    mha.load_state_dict(state)
    assert gqa.layers[0].attn.wk.weight.shape == (16, 64)
    ids = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_vocab_padding(arch):
    torch.manual_seed(0)
    model = build_model(tiny(arch, vocab_size=0, vocab_pad_multiple=64), vocab_size=100)
    assert model.tok_emb.weight.shape == (128, 64)
    assert model.cfg.vocab_size == 100 and model.vocab_size == 100
    ids = torch.randint(0, 100, (2, 8))
    assert model(ids).shape == (2, 8, 100)
    # Padded rows never influence the output.
    with torch.no_grad():
        before = model(ids)
        model.tok_emb.weight[100:] = 1e3
        if model.lm_head is not None:
            model.lm_head.weight[100:] = 1e3
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)


@pytest.mark.parametrize("pad", [64, 1])
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_training_loss_equals_the_loss_of_the_sliced_logits(arch, pad):
    """``model(x, targets=y)`` masks the padded vocab in place instead of slicing the logits:
    the same loss and gradients as cross-entropy over ``model(x)``."""
    torch.manual_seed(0)
    model = build_model(tiny(arch, vocab_size=0, vocab_pad_multiple=pad), vocab_size=100)
    ids, targets = torch.randint(0, 100, (2, 8)), torch.randint(0, 100, (2, 8))
    loss = model(ids, targets=targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_init_deterministic_and_scaled(arch):
    cfg = tiny(arch, n_layers=8, d_model=128, n_heads=4, vocab_size=512)
    torch.manual_seed(1)
    a = build_model(cfg).state_dict()
    torch.manual_seed(1)
    b = build_model(cfg).state_dict()
    torch.manual_seed(2)
    c = build_model(cfg).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq.weight"], c["layers.0.attn.wq.weight"])
    assert abs(a["layers.0.attn.wq.weight"].std().item() - 0.02) < 0.002
    for key in ("layers.3.attn.wo.weight", "layers.3.mlp.w_down.weight"):
        assert abs(a[key].std().item() - 0.02 / 4.0) < 0.0005  # 1 / sqrt(2 * 8 layers)
    for key, t in a.items():
        if t.dim() == 1:  # 1-D tensors are exactly norm gains and biases
            expected = 1.0 if key.endswith("norm.weight") else 0.0
            assert key.endswith(("norm.weight", "norm.bias", ".bias")), key
            assert torch.all(t == expected), key


def test_flops_per_token_formula():
    cfg = tiny("llama", n_heads=4, n_kv_heads=2, ffn_dim=256)
    model = build_model(cfg, device="meta")
    d, v, L, T = 64, 100, 2, 32
    per_layer = d * d + 2 * d * (d // 2) + d * d + 3 * d * 256 + 2 * d
    n_nonemb = L * per_layer + d + v * d  # blocks + final norm + untied head
    assert model.num_params(exclude_embeddings=True) == n_nonemb
    assert model.num_params() == n_nonemb + v * d
    assert model.flops_per_token(T) == 6 * n_nonemb + 12 * L * d * T
    # GPT: tied head still costs its matmul; position table is an embedding.
    gpt = build_model(tiny("gpt"), device="meta")
    assert gpt.num_params() - gpt.num_params(True) == v * d + 32 * d
    assert gpt.flops_per_token(T) == 6 * (gpt.num_params(True) + v * d) + 12 * L * d * T


def test_resolves_defaults_and_accepts_omegaconf():
    node = OmegaConf.structured(ModelConfig(arch="llama", d_model=384, n_heads=6))
    cfg = resolve_config(node, vocab_size=7)
    assert (cfg.ffn_dim, cfg.n_kv_heads, cfg.vocab_size) == (1024, 6, 7)
    assert resolve_config(ModelConfig(arch="gpt"), vocab_size=7).ffn_dim == 4 * 256
    model = build_model(OmegaConf.create({"arch": "gpt", "n_layers": 1}), vocab_size=11)
    assert model.cfg.vocab_size == 11 and model.cfg.n_layers == 1


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(arch="mamba"), "arch"),
        (dict(d_model=100, n_heads=3), "divisible by model.n_heads"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(arch="gpt", n_heads=4, n_kv_heads=2), "GPT has no grouped-query"),
        (dict(n_layers=0), "n_layers"),
        (dict(vocab_pad_multiple=0), "vocab_pad_multiple"),
        (dict(dropout=1.0), "dropout"),
        (dict(ffn_dim=-1), "ffn_dim"),
        (dict(d_model=12, n_heads=4), "even head_dim"),
        (dict(init_std=0.0), "init_std"),
    ],
)
def test_bad_config_raises(changes, message):
    with pytest.raises(ValueError, match=message):
        build_model(dataclasses.replace(tiny(), **changes), device="meta")


def test_vocab_errors():
    with pytest.raises(ValueError, match="no tokenizer vocab size"):
        build_model(tiny(vocab_size=0), device="meta")
    with pytest.raises(ValueError, match="tokenizer has 101 tokens"):
        build_model(tiny(vocab_size=100), vocab_size=101, device="meta")
    assert build_model(tiny(vocab_size=100), vocab_size=90, device="meta").vocab_size == 100


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_too_long_input_raises(arch):
    model = build_model(tiny(arch))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))
