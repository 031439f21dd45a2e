"""The data pipeline on real files: lossless packing, disjoint ranks, exact resume, bad input."""

from __future__ import annotations

import io
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from scape_train.data import (DataConfig, HubUnavailableError, TokenizerConfig, build_tokenizer,
                              build_train_loader, build_val_batches)
from scape_train.data.sources import Cursor, DocStream, open_shards

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt2(shared_data):
    cfg = DataConfig(tokenizer=TokenizerConfig(kind="gpt2", path=str(shared_data / "tokenizers/gpt2")))
    return build_tokenizer(cfg)


def classics_cfg(shared_data, **kw) -> DataConfig:
    base = dict(source="local", path=str(shared_data / "corpus/classics"), seq_len=64, num_workers=1,
                prefetch=4, val_tokens=2048)
    base.update(kw)
    return DataConfig(**base)


def take(loader, n):
    out = [next(loader) for _ in range(n)]
    return [torch.cat([x, y[:, -1:]], dim=1) for x, y in out]   # back to the seq_len+1 blocks


def reload(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def reference_stream(hf, texts, eos):
    ids = []
    for t in texts:
        ids += hf.encode(t, add_special_tokens=False) + [eos]
    return ids


def read_texts(path):
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


def test_packing_is_lossless_and_targets_shift(shared_data, gpt2):
    cfg = classics_cfg(shared_data)
    loader = build_train_loader(cfg, gpt2, micro_batch_size=4)
    x, y = next(loader)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    blocks = [torch.cat([x, y[:, -1:]], 1)] + take(loader, 9)
    loader.close()
    flat = torch.cat([b.reshape(-1) for b in blocks]).tolist()
    # Independent path: json + the transformers tokenizer, docs joined with EOS.
    texts = read_texts(shared_data / "corpus/classics/train.jsonl")[:40]
    ref = reference_stream(gpt2.hf, texts, 50256)
    assert flat == ref[:len(flat)]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_see_disjoint_records_single_file(shared_data, gpt2, world):
    texts = read_texts(shared_data / "corpus/classics/train.jsonl")[:60]
    seen = []
    for rank in range(world):
        loader = build_train_loader(classics_cfg(shared_data), gpt2, 2, rank=rank, world_size=world)
        flat = torch.cat([b.reshape(-1) for b in take(loader, 6)]).tolist()
        loader.close()
        assert flat == reference_stream(gpt2.hf, texts[rank::world], 50256)[:len(flat)]
        seen.append(flat)
    assert len({tuple(s[:200]) for s in seen}) == world


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_files_disjoint_and_complete(tmp_path, world):
    for f in range(4):
        with open(tmp_path / f"part{f}.jsonl", "w") as fh:
            for i in range(5):
                fh.write(json.dumps({"text": f"doc {f}-{i}"}) + "\n")
    cfg = DataConfig(source="local", path=str(tmp_path), val_split=None, val_docs=2)
    shards = open_shards(cfg, cfg.train_split)
    per_rank = []
    for rank in range(world):
        stream = DocStream(shards, rank, world, seed=0, window=1, field="text", holdout=2)
        docs = []
        for text, _, after in stream.iter_docs(Cursor()):
            if after.epoch > 0:
                break
            docs.append(text)
        per_rank.append(set(docs))
    union = set().union(*per_rank)
    assert sum(len(s) for s in per_rank) == len(union) == 20 - 2     # disjoint, all but the held-out
    assert not union & {"doc 0-0", "doc 0-1"}


@pytest.fixture(scope="module")
def classics_parquet(shared_data, tmp_path_factory):
    """The classics corpus as parquet files of many small row groups (a hub-like source)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path_factory.mktemp("classics_parquet")
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in open(shared_data / f"corpus/classics/{split}.jsonl",
                                                  encoding="utf-8")]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet", row_group_size=64)
    return out


@pytest.mark.parametrize("workers,kind", [(1, "jsonl"), (2, "jsonl"), (1, "parquet"),
                                          (2, "parquet")])
def test_resume_after_one_and_two_interruptions_is_exact(shared_data, gpt2, workers, kind,
                                                         request):
    path = (shared_data / "corpus/classics" if kind == "jsonl"
            else request.getfixturevalue("classics_parquet"))
    cfg = classics_cfg(shared_data, shuffle_buffer=16, num_workers=workers, path=str(path))
    full = take(build_train_loader(cfg, gpt2, 3, rank=1, world_size=2), 30)
    got, state = [], None
    for n in (7, 11, 12):                      # two interruptions, each a fresh loader
        loader = build_train_loader(cfg, gpt2, 3, rank=1, world_size=2)
        if state is not None:
            loader.load_state_dict(reload(state))
        got += take(loader, n)
        time.sleep(0.05)                       # let the worker prefetch past the returned batches
        state = loader.state_dict()
        loader.close()
    assert all(torch.equal(a, b) for a, b in zip(full, got)) and len(got) == 30


def test_resume_across_epochs_and_shuffle_windows(tmp_path, gpt2):
    for f in range(3):
        with open(tmp_path / f"train-{f}.jsonl", "w") as fh:
            for i in range(7):
                fh.write(json.dumps({"text": f"file {f} document {i} " * (3 + i)}) + "\n")
    cfg = DataConfig(source="local", path=str(tmp_path), val_split=None, val_docs=1, seq_len=16,
                     shuffle_buffer=4, num_workers=1)
    full = take(build_train_loader(cfg, gpt2, 2), 60)
    loader = build_train_loader(cfg, gpt2, 2)
    got = take(loader, 25)
    assert loader.metrics()["data/epoch"] >= 1
    for n in (17, 18):
        state = reload(loader.state_dict())
        loader.close()
        loader = build_train_loader(cfg, gpt2, 2)
        loader.load_state_dict(state)
        got += take(loader, n)
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(full, got)) and len(got) == 60


def _parquet(path: Path, n: int, row_group: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": f"document {i}"} for i in range(n)]), path,
                   row_group_size=row_group)
    return path


@pytest.fixture
def tables_read(monkeypatch):
    """Counts the tables (record batches: here one per row group) read from parquet files."""
    from datasets.packaged_modules.parquet import parquet as pq_builder

    count = [0]
    real = pq_builder.Parquet._generate_tables

    def counting(self, *args, **kwargs):
        for item in real(self, *args, **kwargs):
            count[0] += 1
            yield item

    monkeypatch.setattr(pq_builder.Parquet, "_generate_tables", counting)
    return count


def _cursor_after(cfg, n: int, window: int = 1) -> Cursor:
    stream = DocStream(open_shards(cfg, cfg.train_split), 0, 1, seed=0, window=window, field="text")
    for i, (_, _, after) in enumerate(stream.iter_docs(Cursor())):
        if i + 1 == n:
            return after
    raise AssertionError("stream too short")


@pytest.mark.parametrize("window", [1, 8])
def test_parquet_resume_cost_does_not_grow_with_position(tmp_path, tables_read, window):
    """Resuming near the end of a 40-row-group file reads as much as resuming at record 10: the
    row group it lands in (and at most the one before), never the file from its start."""
    cfg = DataConfig(source="local", path=str(_parquet(tmp_path / "train.parquet", 1000, 25)),
                     val_split=None, val_docs=0)
    reads, texts = {}, {}
    for n in (10, 990):
        cursor = _cursor_after(cfg, n, window)
        expect = next(t for i, (t, _, _) in enumerate(DocStream(
            open_shards(cfg, cfg.train_split), 0, 1, 0, window, "text").iter_docs(Cursor()))
            if i == n)
        tables_read[0] = 0
        stream = DocStream(open_shards(cfg, cfg.train_split), 0, 1, seed=0, window=window,
                           field="text")
        texts[n] = next(stream.iter_docs(cursor))[0]
        reads[n] = tables_read[0]
        assert texts[n] == expect                       # exact: the very next document
    assert reads[10] <= 2 and reads[990] <= reads[10] + 1, reads


def test_stream_state_that_stops_advancing_cannot_break_resume(tmp_path, caplog):
    """A ``datasets`` regression froze ``state_dict()`` after a resume (huggingface/datasets#8308):
    such a state is dropped and the record index resumes, exactly, however many resumes follow."""
    from scape_train.data import sources

    class FrozenAfterResume:          # the bug, reproduced around a real streaming dataset
        def __init__(self, ds):
            self.ds, self.frozen = ds, None

        def state_dict(self):
            return self.frozen if self.frozen is not None else self.ds.state_dict()

        def load_state_dict(self, state):
            self.frozen = self.ds.state_dict()
            self.ds.load_state_dict(state)

        def __iter__(self):
            return iter(self.ds)

    cfg = DataConfig(source="local", path=str(_parquet(tmp_path / "train.parquet", 300, 20)),
                     val_split=None, val_docs=0)
    real_local_shard = sources._local_shard

    def buggy(path):
        shard = real_local_shard(path)
        make = shard._factory
        shard._factory = lambda: FrozenAfterResume(make())
        return shard

    def docs_from(cursor, n):
        stream = DocStream([buggy(f) for f in sources._split_files(cfg, cfg.train_split)], 0, 1,
                           seed=0, window=1, field="text")
        out = []
        for text, _, after in stream.iter_docs(cursor):
            out.append(text)
            if len(out) == n:
                return out, after

    straight, _ = docs_from(Cursor(), 250)
    got, cursor = docs_from(Cursor(), 50)
    for n in (100, 100):                               # two resumes, the second from a frozen state
        more, cursor = docs_from(cursor, n)
        got += more
    assert got == straight
    assert "did not advance after a resume" in caplog.text


def test_bad_records_skipped_counted_and_stream_unchanged(tmp_path, gpt2):
    good = [f"good document number {i}, with some words." for i in range(12)]
    bad = [b"this is not json", b'{"text": ""}', b'{"title": "no text field"}', b'{"text": 42}',
           b'{"text": "bad bytes \xff\xfe here"}', b'{"text": "truncated', b"[1, 2]"]
    lines = []
    for i, g in enumerate(good):
        lines.append(json.dumps({"text": g}).encode())
        if i < len(bad):
            lines.append(bad[i])
    (tmp_path / "dirty").mkdir()
    (tmp_path / "clean").mkdir()
    (tmp_path / "dirty/train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "clean/train.jsonl").write_bytes(b"\n".join(json.dumps({"text": g}).encode()
                                                            for g in good) + b"\n")
    cfg = DataConfig(source="local", val_split=None, val_docs=0, seq_len=8, num_workers=1)
    dirty = build_train_loader(replace(cfg, path=str(tmp_path / "dirty")), gpt2, 2)
    clean = build_train_loader(replace(cfg, path=str(tmp_path / "clean")), gpt2, 2)
    a, b = take(dirty, 6), take(clean, 6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    m = dirty.metrics()
    dirty.close(), clean.close()
    assert m["data/skipped_records"] == len(bad)
    for reason in ("bad_json", "empty", "missing_field", "not_a_string", "bad_utf8", "not_an_object"):
        assert m[f"data/skipped/{reason}"] >= 1, reason


def test_empty_path_errors_name_the_path(tmp_path, gpt2):
    (tmp_path / "empty").mkdir()
    for path in (str(tmp_path / "empty"), str(tmp_path / "nothing-*.jsonl")):
        with pytest.raises(FileNotFoundError, match="nothing|empty"):
            build_train_loader(DataConfig(source="local", path=path, val_split=None), gpt2, 2)


def test_hub_unreachable_fails_fast_naming_the_offline_alternative(monkeypatch, gpt2):
    cfg = DataConfig(source="openwebtext", path="Skylion007/openwebtext", val_split=None)
    t0 = time.perf_counter()
    with pytest.raises(HubUnavailableError, match="data=local data.path="):
        build_train_loader(cfg, gpt2, 2)                  # HF_HUB_OFFLINE=1 (conftest)
    with pytest.raises(HubUnavailableError, match="data.tokenizer.path="):
        build_tokenizer(DataConfig(tokenizer=TokenizerConfig(kind="gpt2", path=None)))
    assert time.perf_counter() - t0 < 5
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    from scape_train.data.hub import _probe_target
    import socket
    try:
        socket.create_connection(_probe_target(), timeout=2).close()
        pytest.skip("this machine reaches the hub; the no-network path cannot be exercised")
    except OSError:
        pass
    t0 = time.perf_counter()
    with pytest.raises(HubUnavailableError, match="data=local data.path="):
        build_train_loader(cfg, gpt2, 2)
    assert time.perf_counter() - t0 < 10


def test_state_rejects_another_world_size_and_tokenizer(shared_data, gpt2):
    cfg = classics_cfg(shared_data, num_workers=0)
    loader = build_train_loader(cfg, gpt2, 2, rank=0, world_size=2)
    take(loader, 2)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="world size"):
        build_train_loader(cfg, gpt2, 2, rank=0, world_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="tokenizer"):
        build_train_loader(cfg, gpt2, 2, rank=0, world_size=2).load_state_dict(
            dict(state, tokenizer="0" * 16))


def test_val_batches_fixed_and_independent_of_world_size(shared_data, gpt2):
    cfg = classics_cfg(shared_data, val_tokens=64 * 10)
    one = build_val_batches(cfg, gpt2, 4)
    assert [x.shape[0] for x, _ in one] == [4, 4, 2]
    ref = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in one])
    for world in (2, 3):
        parts = [build_val_batches(cfg, gpt2, 4, rank=r, world_size=world) for r in range(world)]
        got = torch.cat([torch.cat([x, y[:, -1:]], 1) for p in parts for x, y in p])
        assert torch.equal(got, ref)
    texts = read_texts(shared_data / "corpus/classics/validation.jsonl")[:10]
    assert ref.reshape(-1).tolist() == reference_stream(gpt2.hf, texts, 50256)[:ref.numel()]


def test_classics_default_runs_from_the_package(tmp_path):
    cfg = DataConfig(seq_len=32, val_tokens=256, num_workers=1)
    cfg.tokenizer.cache_dir = str(tmp_path)
    cfg.tokenizer.vocab_size = 512
    cfg.tokenizer.train_max_bytes = 300_000           # a small slice: this test is about the path
    tok = build_tokenizer(cfg)
    assert tok.vocab_size == 512 and tok.bos_id is None
    loader = build_train_loader(cfg, tok, 2)
    x, _ = next(loader)
    loader.close()
    assert x.shape == (2, 32) and int(x.max()) < 512
    assert len(build_val_batches(cfg, tok, 4)) == 2


@pytest.mark.parametrize("name", ["classics", "local", "openwebtext", "slimpajama6b", "fineweb"])
def test_data_configs_match_the_schema(name):
    from omegaconf import OmegaConf
    node = OmegaConf.merge(OmegaConf.structured(DataConfig),
                           OmegaConf.load(REPO / "configs" / "data" / f"{name}.yaml"))
    assert node.source == name


@pytest.mark.parametrize("tokenizer", ["gpt2", "sentencepiece"])
def test_tokenizer_processes_give_the_inline_stream_and_resume_mid_epoch(shared_data, tokenizer):
    """num_workers=3 (two tokenizer processes, chunks in flight) gives the same batches as
    tokenizing inline (num_workers=0), and its state resumes a fresh process-backed loader at the
    same next batch, mid-epoch, whatever the workers had tokenized ahead."""
    path = shared_data / ("tokenizers/gpt2" if tokenizer == "gpt2"
                          else "tokenizers/sentencepiece-32k")
    tok = build_tokenizer(DataConfig(tokenizer=TokenizerConfig(kind=tokenizer, path=str(path))))
    cfg = classics_cfg(shared_data, num_workers=0, seq_len=128)
    full = take(build_train_loader(cfg, tok, 4), 24)
    cfg = replace(cfg, num_workers=3)
    got, state = [], None
    for n in (9, 15):
        loader = build_train_loader(cfg, tok, 4)
        if state is not None:
            loader.load_state_dict(reload(state))
        got += take(loader, n)
        assert isinstance(loader._pool, ProcessPoolExecutor)
        time.sleep(0.2)                        # the workers tokenize past the returned batches
        state = loader.state_dict()
        loader.close()
    assert len(got) == 24 and all(torch.equal(a, b) for a, b in zip(full, got))
