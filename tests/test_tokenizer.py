"""Tokenizer kinds on the real vocabularies: ids, special tokens, export, the trained-BPE cache."""

from __future__ import annotations

import json
import time

import pytest

from scape_train.data import DataConfig, TokenizerConfig, build_tokenizer

TEXTS = ["Hello world", "  leading spaces\n\nand a blank line", "Thou art more lovely — and more temperate.",
         "unicode: café, naïve, 東京"]


def tok_cfg(kind, path, **kw):
    return DataConfig(tokenizer=TokenizerConfig(kind=kind, path=str(path), **kw))


def test_gpt2_known_ids_and_export(shared_data, tmp_path):
    from transformers import AutoTokenizer

    tok = build_tokenizer(tok_cfg("gpt2", shared_data / "tokenizers/gpt2"))
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert [again.encode(t, add_special_tokens=False) for t in TEXTS] == tok.encode_batch(TEXTS)


def test_sentencepiece_matches_the_model_file(shared_data):
    import sentencepiece as spm

    d = shared_data / "tokenizers/sentencepiece-32k"
    tok = build_tokenizer(tok_cfg("sentencepiece", d))
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32000, 1, 2)
    assert tok.encode("Hello world") == sp.encode("Hello world") == [22557, 1526]
    assert tok.encode(TEXTS[2]) == sp.encode(TEXTS[2])
    gpt2 = build_tokenizer(tok_cfg("gpt2", shared_data / "tokenizers/gpt2"))
    assert tok.fingerprint != gpt2.fingerprint


def test_trained_bpe_is_cached_keyed_and_exportable(tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "train.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog " * 5}) + "\n")
    cfg = DataConfig(source="local", path=str(corpus), val_split=None,
                     tokenizer=TokenizerConfig(kind="trained_bpe", vocab_size=400, cache_dir=str(tmp_path / "c")))
    tok = build_tokenizer(cfg)
    assert tok.vocab_size == 400 and tok.eos_id == 0
    assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
    t0 = time.perf_counter()
    again = build_tokenizer(cfg)
    assert again.fingerprint == tok.fingerprint and time.perf_counter() - t0 < 2
    assert len(list((tmp_path / "c").glob("bpe400-*/tokenizer.json"))) == 1
    cfg.tokenizer.vocab_size = 350                       # another key -> another entry
    assert build_tokenizer(cfg).fingerprint != tok.fingerprint
    tok.save_pretrained(tmp_path / "export")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert hf.encode("lazy dog 17", add_special_tokens=False) == tok.encode("lazy dog 17")


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="gpt2\\|sentencepiece\\|hf\\|trained_bpe"):
        build_tokenizer(DataConfig(tokenizer=TokenizerConfig(kind="wordpiece")))
