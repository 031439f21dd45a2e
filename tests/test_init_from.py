"""``init_from=hf:<dir>``: continue pretraining from Hugging Face weights (GPT-2 and Llama), with the
tokenizer taken from the same directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scape_train.config import ConfigError
from scape_train.data import build_tokenizer, build_train_loader
from scape_train.init_from import apply_init_from
from scape_train.train import run
from tests.helpers import SMALL, compose_config

transformers = pytest.importorskip("transformers")


def save_tiny(kind: str, out: Path, shared: Path, **overrides) -> Path:
    """A tiny random HF model with a real tokenizer, as ``save_pretrained`` writes them."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=50257,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg.update(overrides)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))
        tok = transformers.GPT2Tokenizer.from_pretrained(str(shared / "tokenizers" / "gpt2"))
    else:
        cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=32000, max_position_embeddings=64,
                   rope_theta=1e4, rms_norm_eps=1e-5)
        cfg.update(overrides)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
        tok = transformers.LlamaTokenizer.from_pretrained(str(shared / "tokenizers" / "sentencepiece-32k"))
    with torch.no_grad():  # non-trivial norm gains and biases
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(mean=p.mean().item(), std=0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def job(tmp_path, source, *extra):
    return compose_config(SMALL + [f"run_dir={tmp_path / 'run'}", f"init_from=hf:{source}",
                                   "data.seq_len=32", "trainer.max_steps=2", "trainer.sample_tokens=0",
                                   *extra])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_loss_at_step0_equals_the_hf_models(kind, tmp_path, shared_data):
    source = save_tiny(kind, tmp_path / kind, shared_data)
    cfg = job(tmp_path, source)
    run(cfg)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1      # the loss of step 1 is the initial weights' loss on batch 1

    derived = apply_init_from(cfg)
    tokenizer = build_tokenizer(derived.data)
    x, y = next(build_train_loader(derived.data, tokenizer, derived.trainer.micro_batch_size, 0, 1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        expected = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert first["loss"] == pytest.approx(expected, rel=1e-5)

    # the model shape and tokenizer came from the weights, and the run records them
    assert derived.model.arch == ("gpt" if kind == "gpt2" else "llama")
    assert derived.model.n_layers == 2 and derived.model.d_model == 32
    assert derived.data.tokenizer.kind == "hf" and derived.data.tokenizer.path == str(source)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "d_model: 32" in saved and f"init_from: hf:{source}" in saved
    # and the run's tokenizer is the HF directory's
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    assert tokenizer.vocab_size == (50257 if kind == "gpt2" else 32000)


def test_padded_vocab_keeps_the_loss(tmp_path, shared_data):
    source = save_tiny("llama", tmp_path / "llama", shared_data)
    run(job(tmp_path, source, "model.vocab_pad_multiple=64"))
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    run(job(plain_dir, source))
    loss = [json.loads(p.read_text().splitlines()[0])["loss"]
            for p in (tmp_path / "run" / "metrics.jsonl", plain_dir / "run" / "metrics.jsonl")]
    assert loss[0] == pytest.approx(loss[1], rel=1e-6)


def test_clear_errors(tmp_path, shared_data):
    # more tokens than embedding rows
    small_vocab = save_tiny("llama", tmp_path / "small", shared_data, vocab_size=1000)
    with pytest.raises(ConfigError, match="32000 tokens but the weights only 1000"):
        apply_init_from(job(tmp_path, small_vocab))
    # a sequence longer than the weights' context
    source = save_tiny("gpt2", tmp_path / "gpt2", shared_data)
    with pytest.raises(ConfigError, match="exceeds the context"):
        apply_init_from(job(tmp_path, source, "data.seq_len=128", "model.max_seq_len=128"))
    # no tokenizer beside the weights
    bare = tmp_path / "bare"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                         vocab_size=300)).save_pretrained(bare)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        apply_init_from(job(tmp_path, bare))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        apply_init_from(job(tmp_path, tmp_path / "missing"))
    with pytest.raises(ConfigError, match="init_from must be hf:"):
        run(compose_config(SMALL + [f"run_dir={tmp_path / 'x'}", f"init_from={source}"]))
    # an unsupported variant says what
    odd = save_tiny("gpt2", tmp_path / "odd", shared_data, activation_function="relu")
    with pytest.raises(ValueError, match="activation"):
        apply_init_from(job(tmp_path, odd))
