"""Generation: the KV cache, greedy decoding against transformers' ``generate``, sampling, the
``python -m scape_train.generate`` entry, and the trainer's end-of-run sample."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scape_train.models import ModelConfig, build_model, export_hf
from scape_train.models.cache import new_cache
from scape_train.models.generation import generate, sample_next
from tests import _fault_job as fj
from tests.helpers import SMALL, compose_config

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]

ARCHS = {
    "llama": dict(arch="llama", n_kv_heads=2, rope_theta=1e4),
    "gpt": dict(arch="gpt", tie_embeddings=True, bias=True),
}


def tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    # init_std 0.15: logits far enough apart that argmax is not decided by float noise
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, max_seq_len=64, vocab_size=100,
                      init_std=0.15, **ARCHS[arch])
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(mean=p.mean().item(), std=0.1)
    return model


PROMPTS = [[11, 42, 7, 93, 5, 61, 20], [5, 6, 7], [9]]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_equals_transformers_generate(arch, tmp_path):
    """Token for token: ours (cached and uncached) == HF's generate(do_sample=False) on the export,
    for one prompt and for a left-padded batch."""
    model = tiny(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(model, tmp_path / arch)).eval()
    n = 30
    prompt = torch.tensor([PROMPTS[0]])
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                      max_new_tokens=n)[0, prompt.shape[1]:].tolist()
    assert len(ref) == n
    assert generate(model, [PROMPTS[0]], n) == [ref]
    assert generate(model, [PROMPTS[0]], n, use_cache=False) == [ref]

    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    hf_batch = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                           pad_token_id=0)[:, width:].tolist()
    ours = generate(model, PROMPTS, 20)
    assert ours == hf_batch
    assert ours == generate(model, PROMPTS, 20, use_cache=False)
    assert ours == [generate(model, [p], 20)[0] for p in PROMPTS]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_cached_logits_equal_the_training_forward(arch):
    """Prefill + one token at a time through the cache == the plain forward, row by row; padded
    rows of a batch == the same prompt alone."""
    model = tiny(arch)
    seq = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    full = model(seq)
    cache = new_cache(model, 20)
    parts = [model(seq[:, :8], cache=cache)]
    parts += [model(seq[:, i:i + 1], cache=cache) for i in range(8, 14)]
    parts.append(model(seq[:, 14:], cache=cache))          # a chunk after a prefix
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=2e-5)
    assert len(cache) == 20

    # row 1 left-padded by 5: its real tokens see only themselves
    pad = torch.tensor([0, 5])
    batch = seq.clone()
    batch[1, :5] = 0
    batch[1, 5:] = seq[1, :15]
    cache = new_cache(model, 20, pad)
    out = torch.cat([model(batch[:, :12], cache=cache), model(batch[:, 12:16], cache=cache),
                     model(batch[:, 16:], cache=cache)], dim=1)
    torch.testing.assert_close(out[0], full[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(out[1, 5:], model(seq[1:, :15])[0], rtol=0, atol=2e-5)
    assert torch.isfinite(out).all()


def test_training_forward_unchanged_and_cache_bounds():
    model = tiny("llama")
    names = sorted(n for n, _ in model.named_parameters())
    assert "layers.0.attn.wq.weight" in names and not any("cache" in n for n in names)
    with pytest.raises(ValueError, match="max_seq_len"):
        new_cache(model, 65)
    cache = new_cache(model, 4)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def test_sampling_is_seeded_and_topk1_is_greedy():
    model = tiny("llama")

    def sample(seed, **kw):
        return generate(model, PROMPTS, 12, generator=torch.Generator().manual_seed(seed), **kw)

    a, b = sample(3, temperature=1.0, top_k=50), sample(3, temperature=1.0, top_k=50)
    assert a == b and a != sample(4, temperature=1.0, top_k=50)
    assert sample(3, temperature=0.7, top_k=1) == generate(model, PROMPTS, 12)
    assert sample(3, temperature=1.0, top_p=1e-6) == generate(model, PROMPTS, 12)
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    picks = {int(sample_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(s)))
             for s in range(40)}
    assert picks == {1, 3}
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


def test_stops_at_eos_and_cuts_to_the_context():
    model = tiny("gpt")
    free = generate(model, [PROMPTS[0]], 10)[0]
    eos = free[3]
    stopped = generate(model, [PROMPTS[0]], 10, eos_id=eos)[0]
    assert stopped == free[:free.index(eos)]
    # 60 prompt tokens in a 64-token context: 4 new tokens at most
    assert len(generate(model, [list(range(60))], 50)[0]) == 4
    with pytest.raises(ValueError, match="no room"):
        generate(model, [list(range(64))], 1)


# -- the entry, on a trained checkpoint and its export --------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from scape_train.train import run

    root = tmp_path_factory.mktemp("gen")
    run(compose_config(SMALL + [f"run_dir={root / 'run'}",
                                f"data.tokenizer.cache_dir={fj.tok_cache(tmp_path_factory)}",
                                "trainer.max_steps=6", "trainer.sample_tokens=0"]))
    return root


def test_entry_checkpoint_export_and_prompts_file(trained, tmp_path):
    from scape_train.export import export_checkpoint
    from scape_train.generate import parse_args, run

    run_dir = trained / "run"
    export = export_checkpoint(run_dir, tmp_path / "hf")
    greedy = ["max_new_tokens=12", "temperature=0"]
    out = io.StringIO()
    text = run(parse_args([f"checkpoint={run_dir}", "prompt=ROMEO:", *greedy]), out=out)[0]
    assert out.getvalue() == "ROMEO:" + text + "\n" and text
    # the export gives the same text (its tokenizer, BOS-less, so prefix=eos as in training)
    assert run(parse_args([f"checkpoint={export}", "prompt=ROMEO:", *greedy]),
               out=io.StringIO()) == [text]
    assert run(parse_args([f"checkpoint=hf:{export}", "prompt=ROMEO:", "prefix=eos", *greedy]),
               out=io.StringIO()) == [text]
    # a file of prompts, batched (left-padded, two batches), == each prompt alone
    prompts = ["ROMEO:", "And God said unto Moses,", "", "JULIET: O Romeo"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = io.StringIO()
    batched = run(parse_args([f"checkpoint={run_dir}", f"prompts_file={tmp_path / 'p.txt'}",
                              "batch_size=2", *greedy]), out=out)
    alone = [run(parse_args([f"checkpoint={run_dir}", f"prompt={p}", *greedy]), out=io.StringIO())[0]
             for p in prompts if p]
    assert batched == alone and batched[0] == text
    assert out.getvalue().count("--- [") == 3
    # seeded sampling reproduces
    sampled = [run(parse_args([f"checkpoint={run_dir}", "prompt=ROMEO:", "seed=5",
                               "max_new_tokens=12"]), out=io.StringIO()) for _ in range(2)]
    assert sampled[0] == sampled[1]
    with pytest.raises(ValueError, match="tempreature"):
        parse_args([f"checkpoint={run_dir}", "tempreature=1"])
    with pytest.raises(ValueError, match="checkpoint="):
        parse_args(["prompt=x"])


@pytest.mark.slow
def test_module_entry_streams(trained):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "scape_train.generate", f"checkpoint={trained / 'run'}",
         "prompt=ROMEO:", "max_new_tokens=8", "temperature=0.8", "top_k=50", "device=auto"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ROMEO:")
    bad = subprocess.run([sys.executable, "-m", "scape_train.generate", "checkpoint=/nonexistent"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "error" in bad.stderr and "Traceback" not in bad.stderr


def test_trainer_prints_a_sample_at_the_end(tmp_path, tmp_path_factory, capsys):
    from scape_train.train import run

    tok = f"data.tokenizer.cache_dir={fj.tok_cache(tmp_path_factory)}"
    summary = run(compose_config(SMALL + [f"run_dir={tmp_path / 'a'}", tok, "trainer.max_steps=2",
                                          "trainer.sample_tokens=6", "trainer.sample_prompt=ROMEO:"]))
    assert summary["sample"].startswith("ROMEO:")
    assert "sample (6 tokens" in capsys.readouterr().out
    summary = run(compose_config(SMALL + [f"run_dir={tmp_path / 'b'}", tok, "trainer.max_steps=2",
                                          "trainer.sample_tokens=0"]))
    assert "sample" not in summary and "sample (" not in capsys.readouterr().out
