"""Hugging Face interop: export to transformers and import back, with logits compared."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from scape_train.models import ModelConfig, build_model, export_hf, load_hf

transformers = pytest.importorskip("transformers")

CASES = {
    "llama_gqa": dict(arch="llama", n_heads=4, n_kv_heads=2, rope_theta=1e5),
    "llama_tied_bias": dict(arch="llama", n_heads=4, n_kv_heads=1, tie_embeddings=True, bias=True),
    "gpt_tied": dict(arch="gpt", tie_embeddings=True, bias=True),
    "gpt_untied_nobias": dict(arch="gpt", tie_embeddings=False, bias=False),
}


def tiny(**kw) -> ModelConfig:
    # init_std 0.15 makes activations O(1), so e.g. exact vs tanh GeLU differ beyond 1e-5.
    base = dict(n_layers=2, d_model=64, n_heads=4, max_seq_len=32, vocab_size=100)
    base.update(norm_eps=1e-6, init_std=0.15)
    base.update(kw)
    return ModelConfig(**base)


def randomize_1d(model: torch.nn.Module) -> None:
    """Non-trivial norm gains and biases, so a dropped or swapped one would show in the logits."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(mean=p.mean().item(), std=0.1)


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.eval()(ids).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip(case, tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny(**CASES[case])).eval()
    randomize_1d(model)
    ids = torch.randint(0, 100, (2, 24))
    ours = model(ids)

    out = export_hf(model, tmp_path / case)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    expected_type = "llama" if model.cfg.arch == "llama" else "gpt2"
    assert json.loads((out / "config.json").read_text())["model_type"] == expected_type
    torch.testing.assert_close(hf_logits(out, ids), ours, rtol=0, atol=1e-5)

    back, cfg = load_hf(out)
    torch.testing.assert_close(back.eval()(ids), ours, rtol=0, atol=0)
    # The imported config is the original one, up to the label and GPT-2's always-present biases.
    same = dataclasses.replace(model.cfg, name=cfg.name, bias=cfg.bias)
    assert cfg == same and back.cfg == cfg
    assert cfg.bias == (model.cfg.bias or model.cfg.arch == "gpt")


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_padded_vocab_exports_trimmed(arch, tmp_path):
    torch.manual_seed(0)
    gpt = arch == "gpt"
    cfg = tiny(arch=arch, vocab_size=0, vocab_pad_multiple=64, tie_embeddings=gpt, bias=gpt)
    model = build_model(cfg, vocab_size=100).eval()
    assert model.tok_emb.weight.shape[0] == 128
    out = export_hf(model, tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 100
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    embed = "model.embed_tokens.weight" if arch == "llama" else "transformer.wte.weight"
    assert shapes[embed] == (100, 64)
    if arch == "llama":
        assert shapes["lm_head.weight"] == (100, 64)
    ids = torch.randint(0, 100, (1, 16))
    torch.testing.assert_close(hf_logits(out, ids), model(ids), rtol=0, atol=1e-5)
    back, back_cfg = load_hf(out)
    assert back_cfg.vocab_pad_multiple == 1 and back.tok_emb.weight.shape[0] == 100
    torch.testing.assert_close(back.eval()(ids), model(ids), rtol=0, atol=0)


def word_tokenizer(n: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, n)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_tokenizer_saved_beside_the_model(tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny(arch="llama", n_kv_heads=2))
    out = export_hf(model, tmp_path / "m", tokenizer=word_tokenizer(100))
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    assert len(reloaded) == 100 and reloaded("w5 w7")["input_ids"] == [5, 7]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    with pytest.raises(ValueError, match="tokenizer has 120 tokens"):
        export_hf(model, tmp_path / "bad", tokenizer=word_tokenizer(120))


def test_export_keeps_dtype_and_strips_wrappers(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = build_model(tiny(arch="llama", n_kv_heads=2)).eval()
    ids = torch.randint(0, 100, (1, 8))
    expected = model(ids)
    # Activation checkpointing is applied from outside by wrapping the blocks.
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
    exported = hf_logits(export_hf(model, tmp_path / "ac"), ids)
    torch.testing.assert_close(exported, expected, rtol=0, atol=1e-5)

    out = export_hf(model.to(torch.bfloat16), tmp_path / "bf16")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


def test_load_rejects_unsupported_models(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2, activation_function="relu"
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "relu")
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        load_hf(tmp_path / "relu")
    bert = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        load_hf(tmp_path / "bert")
