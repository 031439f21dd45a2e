"""Document streams: hub datasets and local files behind one resumable, per-rank cursor.

A source is a list of *shards* (one hub shard, or one local file), each read from a position (a
byte offset for JSON lines, a record index otherwise). Hub sources and local
parquet/text/JSON-array files go through ``datasets.load_dataset(..., streaming=True)``; local JSON
lines are read line by line here, because the ``json`` builder aborts the whole file on one
malformed line while we must skip and count it.

Resume costs the same wherever the cursor is. JSON lines seek to the byte offset. A ``datasets``
stream resumes from its own ``IterableDataset.state_dict()``, taken at the cursor's position and
carried in our ``Cursor`` (``state``), loaded into a FRESH dataset on every resume; parquet streams
(hub or local) are ``reshard()``-ed into one shard per row group, in file order (the same records
in the same order), so that state skips whole row groups unread and a resume reads at most the
row group it lands in and the one before. (Other formats -- local text and JSON arrays -- cannot
be split: their state skips the records before it without decoding them, but the file is still
read from its start.) A ``datasets`` regression froze ``state_dict()`` after a resume, so that the
second resume restarted the stream (huggingface/datasets#8308, in 5.x releases before its fix);
the installed 5.2.0 has the fix (two resumes in a row are exact, fresh or reused dataset), and a
state that has not moved from a fresh dataset's after records were read is detected and dropped:
the cursor then resumes from its record index, exactly, by reading up to it. So the bug cannot
bite. Cursors without a state (position 0, checkpoints of earlier versions) resume that way too.
"""

from __future__ import annotations

import copy
import glob
import gzip
import hashlib
import itertools
import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from scape_train.data.config import DataConfig
from scape_train.data.hub import require_hub

log = logging.getLogger(__name__)

JSONL = (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")
JSON = (".json", ".json.gz")
PARQUET = (".parquet",)
TEXT = (".txt", ".txt.gz", ".md")
SUPPORTED = JSONL + JSON + PARQUET + TEXT
LOCAL_SOURCES = ("local", "classics")
OFFLINE_HINT = "data=local data.path=<file|glob|dir of .jsonl/.parquet/.txt>"


def classics_dir() -> Path:
    """The public-domain sample shipped inside the package (the default job's data)."""
    return Path(__file__).resolve().parents[1] / "assets" / "classics"


# ---------------------------------------------------------------- records -> text

def extract_text(raw: Any, field: str) -> tuple[Optional[str], Optional[str]]:
    """(text, None) for a good record, (None, reason) for one to skip and count."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, "bad_utf8"
        try:
            raw = json.loads(line)
        except ValueError:
            return None, "bad_json"
    if not isinstance(raw, dict):
        return None, "not_an_object"
    if field not in raw:
        return None, "missing_field"
    text = raw[field]
    if not isinstance(text, str):
        return None, "not_a_string"
    if not text.strip():
        return None, "empty"
    try:
        text.encode("utf-8")        # lone surrogates from "\ud800" escapes: the tokenizer would raise
    except UnicodeEncodeError:
        return None, "bad_utf8"
    return text, None


# ---------------------------------------------------------------- shards

class Records:
    """A shard's records from a position: iterates ``(position after, raw record)``; ``state()``
    is the stream's own resume state after the last record yielded (None: the position is all
    a resume needs)."""

    def __init__(self, gen: Iterator[tuple[int, Any]],
                 state: Optional[Callable[[], Optional[dict]]] = None):
        self._gen, self._state = gen, state

    def __iter__(self) -> "Records":
        return self

    def __next__(self) -> tuple[int, Any]:
        return next(self._gen)

    def state(self) -> Optional[dict]:
        return None if self._state is None else self._state()


class JsonlShard:
    """A JSON-lines file (optionally gzip): records are raw lines, positions are byte offsets."""

    def __init__(self, path: Path):
        self.path = path
        self.name = str(path)

    def records(self, pos: int, state: Optional[dict] = None) -> Records:
        return Records(self._lines(pos))

    def _lines(self, pos: int) -> Iterator[tuple[int, Any]]:
        opener = gzip.open if self.path.name.endswith(".gz") else open
        with opener(self.path, "rb") as f:
            f.seek(pos)
            for line in f:
                pos += len(line)
                if line.strip():
                    yield pos, line


class DatasetShard:
    """One shard of a streaming ``datasets.IterableDataset``: positions are record indices, and
    the dataset's own ``state_dict()`` at a position resumes there without re-reading the shard
    (module docstring). ``factory`` builds a fresh dataset each time: a resume never reuses one."""

    def __init__(self, name: str, factory: Callable[[], Any]):
        self.name = name
        self._factory = factory
        self._warned = False

    def records(self, pos: int, state: Optional[dict] = None) -> Records:
        ds = self._factory()
        initial = ds.state_dict()          # a fresh dataset's: what a frozen state looks like
        if state is not None:
            ds.load_state_dict(copy.deepcopy(state))
        consumed = [0]

        def gen() -> Iterator[tuple[int, Any]]:
            it = iter(ds)
            if state is None and pos:
                # No stream state (an earlier version's cursor): read up to the record index.
                for _ in itertools.islice(it, pos):
                    pass
            for i, example in enumerate(it, start=pos + 1):
                consumed[0] += 1
                yield i, example

        def current() -> Optional[dict]:
            now = ds.state_dict()
            if state is not None and consumed[0] and now == initial:
                # huggingface/datasets#8308: the state stopped advancing after the resume. Drop
                # it; the cursor's record index resumes exactly (reading up to it).
                if not self._warned:
                    log.warning("%s: the datasets stream state did not advance after a resume "
                                "(huggingface/datasets#8308); resuming from record indices "
                                "instead (exact, but it re-reads the shard). Upgrade datasets.",
                                self.name)
                    self._warned = True
                return None
            return now

        return Records(gen(), current)


def _row_group_shards(ds):
    """Parquet: one shard per row group, in file order -- the same records in the same order --
    so that the stream's state skips whole row groups on resume. A no-op for other formats."""
    return ds.reshard() if hasattr(ds, "reshard") else ds


def resolve_local_files(spec: str) -> list[Path]:
    """A file, a glob or a directory (searched recursively) -> sorted supported files."""
    p = Path(spec).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUPPORTED))
    else:
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
        raise FileNotFoundError(
            f"no data files found at data.path={spec!r} (expected a file, glob or directory with "
            f"{', '.join(SUPPORTED)})")
    bad = [f for f in files if not f.name.endswith(SUPPORTED)]
    if bad:
        raise ValueError(f"unsupported data file type {bad[0]} (supported: {', '.join(SUPPORTED)})")
    return files


def _local_shard(path: Path) -> JsonlShard | DatasetShard:
    name = path.name
    if name.endswith(JSONL) or (name.endswith(JSON) and _looks_like_json_lines(path)):
        return JsonlShard(path)
    builder, kwargs = ("parquet", {}) if name.endswith(PARQUET) else \
        ("json", {}) if name.endswith(JSON) else ("text", {"sample_by": "paragraph"})

    def factory():
        import datasets
        return _row_group_shards(datasets.load_dataset(builder, data_files=[str(path)],
                                                       split="train", streaming=True, **kwargs))
    return DatasetShard(str(path), factory)


def _looks_like_json_lines(path: Path) -> bool:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"{")


def _split_files(cfg: DataConfig, split: str) -> list[Path]:
    """Local files of a split: val_path if given, else files whose path names the split."""
    base = str(classics_dir()) if cfg.source == "classics" else cfg.path
    if base is None:
        raise ValueError("data.source=local needs data.path=<file|glob|dir>")
    if split != cfg.train_split and cfg.val_path:
        return resolve_local_files(cfg.val_path)
    files = resolve_local_files(base)
    named = [f for f in files if _names_split(f, split)]
    if named:
        return named
    if split == cfg.train_split:
        # No file is named after a split: everything is training data, minus val-named files.
        other = cfg.val_split
        return [f for f in files if not (other and _names_split(f, other))] or files
    raise FileNotFoundError(
        f"no validation files for data.val_split={split!r} under {base!r}: name a file after the "
        f"split, set data.val_path=..., or set data.val_split=null to hold out the first "
        f"data.val_docs training documents")


def _names_split(path: Path, split: str) -> bool:
    parts = [path.name.split(".")[0].split("-")[0]] + [q.lower() for q in path.parent.parts[-2:]]
    return split.lower() in [q.lower() for q in parts]


def _hub_shards(cfg: DataConfig, split: str) -> list[DatasetShard]:
    if not cfg.path:
        raise ValueError(f"data.source={cfg.source!r} reads the hub and needs data.path=<hub dataset id>")
    what = f"dataset {cfg.path!r}" + (f" ({cfg.name})" if cfg.name else "")
    require_hub(what, OFFLINE_HINT)
    import datasets

    try:
        ds = datasets.load_dataset(cfg.path, name=cfg.name, split=split, revision=cfg.revision,
                                   data_dir=cfg.data_dir, streaming=True)
    except ConnectionError as e:
        raise ConnectionError(f"{what} could not be opened ({e}). Offline, use {OFFLINE_HINT}.") from e
    n = ds.num_shards
    return [DatasetShard(f"{cfg.path}[{split}] shard {i}/{n}",
                         lambda i=i: _row_group_shards(ds.shard(num_shards=n, index=i,
                                                                contiguous=True)))
            for i in range(n)]


def open_shards(cfg: DataConfig, split: str) -> list:
    if cfg.source in LOCAL_SOURCES:
        return [_local_shard(f) for f in _split_files(cfg, split)]
    return _hub_shards(cfg, split)


def corpus_identity(cfg: DataConfig) -> dict:
    """What the trained tokenizer's cache key depends on: file names, sizes and head hashes."""
    if cfg.source not in LOCAL_SOURCES:
        return {"hub": cfg.path, "name": cfg.name, "revision": cfg.revision, "data_dir": cfg.data_dir,
                "split": cfg.train_split, "field": cfg.text_field}
    files = []
    for f in _split_files(cfg, cfg.train_split):
        with open(f, "rb") as fh:
            head = hashlib.sha256(fh.read(1 << 20)).hexdigest()[:16]
        files.append([f.name, f.stat().st_size, head])
    return {"files": files, "field": cfg.text_field, "holdout": _holdout(cfg)}


def _holdout(cfg: DataConfig) -> int:
    return cfg.val_docs if cfg.val_split is None else 0


# ---------------------------------------------------------------- the per-rank stream

@dataclass
class Cursor:
    """Where a rank's document stream resumes. Windows of ``shuffle_buffer`` documents are re-read
    from (pos, rec) and re-permuted deterministically, so no buffer contents are saved."""
    epoch: int = 0
    shard: int = 0      # index into this rank's shard order of the epoch
    pos: int = 0        # reader position where the current window starts
    rec: int = 0        # records (all ranks') before that position in the shard
    skip: int = 0       # documents of the window already consumed
    state: Optional[dict] = None   # the stream's own resume state at ``pos`` (datasets streams)

    def to_dict(self) -> dict:
        return asdict(self)


class DocStream:
    """This rank's endless stream of (text | None, skip reason | None, cursor after the record).

    Ranks split whole shards when there are at least as many shards as ranks (shard i goes to rank
    i % world), else every rank reads every shard and keeps records with index % world == rank.
    Either way ranks see disjoint records. Records [0, holdout) of shard 0 are the held-out
    validation set and never appear here.
    """

    def __init__(self, shards: list, rank: int, world_size: int, seed: int, window: int, field: str,
                 holdout: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.shards, self.rank, self.world, self.seed = shards, rank, world_size, seed
        self.window, self.field, self.holdout = max(1, window), field, holdout
        n = len(shards)
        self.mine = list(range(rank, n, world_size)) if n >= world_size else list(range(n))
        self.stride = 1 if n >= world_size else world_size

    def _order(self, epoch: int) -> list[int]:
        order = list(self.mine)
        if self.window > 1:
            random.Random(f"shards:{self.seed}:{epoch}").shuffle(order)
        return order

    def _keep(self, sid: int, rec: int) -> bool:
        if sid == 0 and rec < self.holdout:
            return False
        return self.stride == 1 or rec % self.stride == self.rank

    def iter_docs(self, start: Cursor) -> Iterator[tuple[Optional[str], Optional[str], Cursor]]:
        c = Cursor(**start.to_dict())
        while True:
            whole_epoch, good = c == Cursor(epoch=c.epoch), 0
            order = self._order(c.epoch)
            while c.shard < len(order):
                for text, reason, after in self._iter_shard(order[c.shard], c):
                    good += text is not None
                    yield text, reason, after
                c = Cursor(epoch=c.epoch, shard=c.shard + 1)
            if whole_epoch and not good:
                names = ", ".join(self.shards[i].name for i in self.mine) or "(no shards)"
                raise RuntimeError(f"rank {self.rank}/{self.world} found no usable documents with field "
                                   f"{self.field!r} in a whole pass over {names}")
            c = Cursor(epoch=c.epoch + 1)

    def _iter_shard(self, sid: int, c: Cursor):
        it = self.shards[sid].records(c.pos, c.state)
        pos, rec, skip, state = c.pos, c.rec, c.skip, c.state
        while True:
            win_pos, win_rec, win_state, window = pos, rec, state, []
            for pos_after, raw in it:
                keep = self._keep(sid, rec)
                pos, rec = pos_after, rec + 1
                if keep:
                    window.append(raw)
                    if len(window) == self.window:
                        break
            if not window:
                return
            state = it.state()      # after the window's last record: where the next one starts
            perm = list(range(len(window)))
            if self.window > 1:
                random.Random(f"docs:{self.seed}:{c.epoch}:{sid}:{win_rec}").shuffle(perm)
            for j in range(skip, len(window)):
                last = j + 1 == len(window)
                after = Cursor(c.epoch, c.shard, pos if last else win_pos, rec if last else win_rec,
                               0 if last else j + 1, state if last else win_state)
                text, reason = extract_text(window[perm[j]], self.field)
                yield text, reason, after
            skip = 0


def train_stream(cfg: DataConfig, rank: int, world_size: int) -> DocStream:
    return DocStream(open_shards(cfg, cfg.train_split), rank, world_size, cfg.seed, cfg.shuffle_buffer,
                     cfg.text_field, holdout=_holdout(cfg))


def iter_val_texts(cfg: DataConfig) -> Iterator[str]:
    """The validation documents in a fixed order, the same for every rank and world size."""
    if cfg.val_split is not None:
        for shard in open_shards(cfg, cfg.val_split):
            for _, raw in shard.records(0):
                text, _ = extract_text(raw, cfg.text_field)
                if text is not None:
                    yield text
        return
    shard0 = open_shards(cfg, cfg.train_split)[0]
    for i, (_, raw) in enumerate(shard0.records(0)):
        if i >= cfg.val_docs:
            return
        text, _ = extract_text(raw, cfg.text_field)
        if text is not None:
            yield text


def iter_training_texts(cfg: DataConfig, max_bytes: int) -> Iterator[str]:
    """One pass over the training documents (stream order, held-out ones excluded), up to max_bytes."""
    stream = DocStream(open_shards(cfg, cfg.train_split), 0, 1, cfg.seed, 1, cfg.text_field,
                       holdout=_holdout(cfg))
    seen = 0
    for text, _, after in stream.iter_docs(Cursor()):
        if after.epoch > 0 or seen >= max_bytes:
            return
        if text is not None:
            seen += len(text)
            yield text
