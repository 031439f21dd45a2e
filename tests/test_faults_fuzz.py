"""Bad input, generated: invalid configs fail early and clearly; bad data records are skipped.

Configs: hypothesis draws one or two invalid values (wrong range, unknown names, wrong types,
impossible combinations) for trainer/model/data/optimizer/strategy fields. Each must fail at
Hydra composition or in ``validate()`` (which runs before any tokenizer, model or data work) with
a ConfigError/ValueError or a Hydra error whose message names the key; the component builders
(``build_model`` on meta, ``build_optimizer`` on a tiny model) must agree.

Data: hypothesis mixes good documents with random bytes, malformed JSON, wrong types, empty
texts and lone surrogates in a local JSON-lines file; the loader must skip and count every bad
one and produce exactly the token stream of the good ones.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException

from scape_train.config import ConfigError, validate
from scape_train.data import DataConfig, TokenizerConfig, build_tokenizer, build_train_loader
from scape_train.models import build_model
from scape_train.optim import build_optimizer
from tests import _fault_job as fj
from tests.helpers import compose_config

text = st.text(alphabet="abcxyz_-", min_size=1, max_size=8)
nonpos = st.integers(-10**6, 0)
neg = st.integers(-10**6, -1)
# field -> values that must be refused (each drawn value is invalid on its own)
BAD: dict[str, st.SearchStrategy] = {
    "trainer.max_steps": nonpos,
    "trainer.micro_batch_size": nonpos,
    "trainer.global_batch_size": st.sampled_from([3, 5, 6, 7, 9, 10]),  # micro 4, world 1
    "trainer.warmup_steps": st.one_of(neg, st.integers(401, 10**6)),
    "trainer.decay_steps": st.one_of(neg, st.integers(401, 10**6)),
    "trainer.lr_schedule": text,
    "trainer.precision": text,
    "trainer.device": text,
    "trainer.nan_policy": text,
    "trainer.max_nan_skips": neg,
    "trainer.log_every": nonpos,
    "trainer.stop_after": neg,
    "trainer.eval_every": neg,
    "trainer.eval_batches": neg,
    "trainer.checkpoint_every": neg,
    "trainer.keep_last": nonpos,
    "trainer.dist_timeout_s": nonpos,
    "trainer.num_threads": neg,
    "trainer.compile": text,
    "trainer.activation_checkpointing": text,
    "trainer.loss_chunk_tokens": neg,
    "model.arch": text,
    "model.n_layers": nonpos,
    "model.d_model": nonpos,
    "model.n_heads": nonpos,
    "model.n_kv_heads": st.one_of(neg, st.sampled_from([3, 5, 6, 7])),  # n_heads=4
    "model.ffn_dim": neg,
    "model.vocab_size": neg,
    "model.vocab_pad_multiple": nonpos,
    "model.init_std": st.floats(-1e3, 0.0),
    "model.norm_eps": st.floats(-1.0, 0.0),
    "model.rope_theta": st.floats(-1e4, 0.0),
    "model.dropout": st.one_of(st.floats(-5, -1e-6), st.floats(1.0, 5.0)),
    "data.seq_len": st.one_of(nonpos, st.integers(257, 10**5)),  # model.max_seq_len=256
    "data.val_tokens": nonpos,
    "data.shuffle_buffer": neg,
    "data.num_workers": neg,
    "data.prefetch": nonpos,
    "data.text_field": st.just("''"),
    "optimizer.name": text,
    "optimizer.lr": st.floats(-10.0, 0.0),
    "optimizer.eps": st.floats(-1.0, -1e-12),
    "optimizer.weight_decay": st.floats(-1.0, -1e-9),
    "optimizer.clip_grad": st.floats(-10.0, -1e-9),
    "optimizer.betas": st.sampled_from(["[0.9]", "[0.9,1.0]", "[-0.1,0.9]", "[0.9,0.95,0.99]"]),
    "optimizer.bias_correction": text,
    "optimizer.density": st.one_of(st.floats(-1.0, 0.0), st.floats(1.0001, 10.0)),
    "optimizer.density_warmup_steps": neg,
    "optimizer.density_schedule": text,
    "optimizer.partitioner": text,
    "optimizer.use_triton": text,
    "optimizer.powersgd_rank": nonpos,
    "optimizer.powersgd_start_iter": st.integers(-5, 1),
    "optimizer.offload_chunk_numel": nonpos,
    "strategy.topology": text,
    "strategy.outer_lr": st.floats(-1.0, 0.0),
    "strategy.outer_momentum": st.one_of(st.floats(-1.0, -1e-6), st.floats(1.0, 3.0)),
    "strategy.inner_steps": neg,
    "strategy.round_budget_s": st.floats(-100.0, -1e-6),
    "logging.wandb.mode": text,
}
# fields whose invalidity needs a partner (applied together with the drawn value)
NEEDS = {"strategy.topology": ["strategy=gasloc"], "strategy.outer_lr": ["strategy=diloco"],
         "strategy.outer_momentum": ["strategy=diloco"], "strategy.inner_steps": ["strategy=diloco"],
         "strategy.round_budget_s": ["strategy=diloco"], "trainer.global_batch_size": [],
         "model.n_kv_heads": ["model.n_heads=4"]}
# value types Hydra must refuse at composition (a string for a number, and so on)
WRONG_TYPE = st.sampled_from([("trainer.max_steps", "many"), ("model.d_model", "wide"),
                              ("optimizer.lr", "fast"), ("trainer.loss_chunk_tokens", "many"),
                              ("data.seq_len", "1.5"), ("model.dropout", "none"),
                              ("trainer.no_such_key", "1"), ("optimizer.betas", "0.9")])


def _fmt(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _message(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return " | ".join(parts)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = compose_config(["model.n_layers=1", "model.d_model=16", "model.n_heads=2",
                          "model.ffn_dim=32", "model.vocab_size=64"])
    return build_model(cfg.model, device="cpu")


def _refused_early(overrides: list[str], key: str, tiny_model) -> None:
    """Composition or validate() must refuse ``overrides``, naming ``key``'s field."""
    leaf = key.rsplit(".", 1)[1]
    try:
        cfg = compose_config(["model.max_seq_len=256", "trainer.micro_batch_size=4",
                              "trainer.max_steps=400", *overrides])
    except (HydraException, OmegaConfBaseException) as exc:
        assert leaf in _message(exc), (overrides, _message(exc))
        return
    with pytest.raises((ConfigError, ValueError)) as err:
        validate(cfg, 1)
    assert leaf in str(err.value), (overrides, str(err.value))
    # The builders agree: whatever validate() let through for the model/optimizer would build.
    if key.startswith("model."):
        with pytest.raises(ValueError, match=leaf):
            build_model(cfg.model, vocab_size=1024, device="meta")
    if key.startswith("optimizer.") and leaf not in ("lr",):
        with pytest.raises(ValueError, match=leaf):
            build_optimizer(cfg.optimizer, tiny_model)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_invalid_config_values_fail_early_naming_the_key(data, tiny_model):
    key = data.draw(st.sampled_from(sorted(BAD)), label="key")
    value = data.draw(BAD[key], label="value")
    _refused_early([*NEEDS.get(key, []), f"{key}={_fmt(value)}"], key, tiny_model)


@settings(max_examples=10, deadline=None)
@given(case=WRONG_TYPE)
def test_wrong_types_and_unknown_keys_fail_at_composition(case):
    key, value = case
    with pytest.raises((HydraException, OmegaConfBaseException)) as err:
        compose_config([f"{key}={value}"])
    assert key.rsplit(".", 1)[1] in _message(err.value)


COMBOS = [  # valid values one by one, impossible together: (overrides, field the message names)
    (["model.d_model=96", "model.n_heads=5"], "n_heads"),
    (["data.seq_len=512"], "max_seq_len"),
    (["trainer.warmup_steps=50", "trainer.max_steps=10"], "warmup_steps"),
    (["optimizer.min_lr=0.1", "optimizer.lr=0.01"], "min_lr"),
    (["optimizer=adamw", "optimizer.sharded=true"], "sharded"),
    (["optimizer=adams", "optimizer.offload_residuals=true"], "offload_residuals"),
    (["optimizer=scape", "optimizer.eps=0"], "eps"),
    (["strategy=diloco", "optimizer=scape"], "optimizer.name"),
    (["strategy=diloco", "strategy.topology=1peer"], "topology"),
    (["strategy=gasloc", "strategy.inner_steps_per_worker=[3,4]"], "inner_steps_per_worker"),
    (["model=gpt_tiny", "model.n_kv_heads=2"], "n_kv_heads"),
    (["data=local", "data.path=x.jsonl", "data.val_docs=0"], "val_docs"),
]


@pytest.mark.parametrize("overrides,field", COMBOS)
def test_impossible_combinations_fail_early(overrides, field, tiny_model):
    cfg = compose_config(["model.max_seq_len=256", *overrides])
    with pytest.raises((ConfigError, ValueError), match=field.rsplit(".", 1)[-1]):
        validate(cfg, 1)


# ---------------------------------------------------------------- data

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    cache = fj.tok_cache(tmp_path_factory)
    return build_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=1024, cache_dir=cache)))


GOOD = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
               max_size=200).filter(lambda s: s.strip())
BAD_LINE = st.one_of(
    st.binary(min_size=1, max_size=300).filter(lambda b: b.strip() and b"\n" not in b
                                              and b"\r" not in b),          # random bytes
    st.just(b'{"text": "unterminated'), st.just(b'{"text": 5}'), st.just(b'{"text": null}'),
    st.just(b'{"text": ""}'), st.just(b'{"text": "   "}'), st.just(b'{"body": "no text"}'),
    st.just(b'["a", "list"]'), st.just(b'"just a string"'), st.just(b"null"),
    st.just(b'{"text": "lone \\ud800 surrogate"}'), st.just(b"\xff\xfe\x00garbage"),
)


def _jsonl(docs: list[str]) -> bytes:
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)


def _stream(path: Path, tok, seq_len: int, n_blocks: int):
    cfg = DataConfig(source="local", path=str(path), val_split=None, val_docs=1, seq_len=seq_len,
                     num_workers=0)
    loader = build_train_loader(cfg, tok, 1)
    blocks = [torch.cat([x[0, :1], y[0]]) for x, y in islice(loader, n_blocks)]
    metrics = loader.metrics()
    loader.close()
    return blocks, metrics


def _skippable(line: bytes) -> bool:
    """What the loader must skip: anything that is not a JSON object with a non-blank string."""
    try:
        rec = json.loads(line.decode("utf-8"))
        rec["text"].encode("utf-8")
        return not (isinstance(rec, dict) and isinstance(rec["text"], str) and rec["text"].strip())
    except Exception:  # noqa: BLE001 - every failure means "skip"
        return True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(good=st.lists(GOOD, min_size=4, max_size=12), bad=st.lists(BAD_LINE, min_size=1, max_size=12),
       where=st.randoms(use_true_random=False))
def test_bad_records_skipped_counted_good_stream_unchanged(tmp_path_factory, tokenizer, good, bad,
                                                          where):
    bad = [b for b in bad if _skippable(b)]
    lines = [json.dumps({"text": g}).encode() for g in good]
    for b in bad:  # the first line stays good: it is the held-out validation document
        lines.insert(where.randint(1, len(lines) - 1), b)
    lines.append(json.dumps({"text": "the last good document"}).encode())
    tmp = tmp_path_factory.mktemp("fuzzdata")
    (tmp / "dirty.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp / "clean.jsonl").write_bytes(_jsonl([*good, "the last good document"]))
    total = sum(len(ids) + 1 for ids in tokenizer.encode_batch(good[1:] + ["the last good document"]))
    seq_len = 8
    n = total // (seq_len + 1)
    clean, _ = _stream(tmp / "clean.jsonl", tokenizer, seq_len, n)
    dirty, metrics = _stream(tmp / "dirty.jsonl", tokenizer, seq_len, n)
    assert len(dirty) == len(clean) == n
    assert all(torch.equal(a, b) for a, b in zip(dirty, clean))
    assert metrics["data/skipped_records"] == len(bad)


def test_huge_and_empty_documents(tmp_path, tokenizer):
    """A 2 MB document is data (kept, tokenized); an empty one and a 3 MB garbage line are not."""
    words = ("lorem ipsum dolor sit amet consectetur " * 60_000)[:2_000_000]
    # Fillers after it: the loader tokenizes 64 documents at a time, cycling a tiny file's epochs.
    good = ["a short first document", words, *[f"filler document {i}" for i in range(80)]]
    dirty = [_jsonl([good[0]]), b'{"text": ""}\n', b"\x00\xff" * 1_500_000 + b"\n", b"\n\n",
             _jsonl(good[1:])]
    (tmp_path / "dirty.jsonl").write_bytes(b"".join(dirty))
    (tmp_path / "clean.jsonl").write_bytes(_jsonl(good))
    clean, _ = _stream(tmp_path / "clean.jsonl", tokenizer, 64, 200)
    got, metrics = _stream(tmp_path / "dirty.jsonl", tokenizer, 64, 200)
    assert all(torch.equal(a, b) for a, b in zip(got, clean)) and len(got) == 200
    assert metrics["data/skipped_records"] == 2  # the empty text and the garbage line
    assert metrics["data/skipped/empty"] == 1
