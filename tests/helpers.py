"""Small shared helpers for tests: composing the real Hydra config."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from scape_train.config import Config, register_configs, to_object

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

# A small, fast job: 2 blocks of width 64 on the shipped public-domain sample.
SMALL = [
    "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=128", "model.max_seq_len=64", "data.seq_len=64", "data.val_tokens=2048",
    "data.tokenizer.vocab_size=1024", "trainer.micro_batch_size=4", "trainer.warmup_steps=2",
    "trainer.log_every=1", "trainer.eval_every=0", "trainer.num_threads=1",
    "logging.wandb.mode=disabled", "logging.progress_bar=false", "optimizer.lr=3e-3",
]


def compose_config(overrides: list[str] | None = None) -> Config:
    """The typed config exactly as ``python -m scape_train <overrides>`` would build it."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        node = compose(config_name="config", overrides=list(overrides or []))
    return to_object(node)


def wandb_records(run_dir: Path, wait_s: float = 20.0) -> list:
    """The ``Record`` protobufs of a finished offline W&B run's transaction log ``run-<id>.wandb``.
    wandb 0.31's ``run.finish()`` can return before its service has written the log, so this
    waits (up to ``wait_s``) for the run's closing ``exit`` record."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        records = _wandb_log(next(Path(run_dir).glob("run-*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _wandb_log(path: Path) -> list:
    """W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of records (crc32c, length,
    type FULL/FIRST/MIDDLE/LAST), each record a ``Record`` protobuf."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                       # a block's tail too short for a record: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):   # being written: the rest comes later
            break
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows (``_step`` and the logged keys, values parsed) of an offline W&B run."""
    import json

    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in r.history.item}
            for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]


def wandb_config_keys(run_dir: Path) -> set[str]:
    """The top-level config keys an offline W&B run recorded."""
    keys: set[str] = set()
    for r in wandb_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = r.run.config.update if kind == "run" else r.config.update
            keys.update(item.key or item.nested_key[0] for item in items)
    return keys


def metrics_rows(run_dir: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` rows."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def total_sent_bytes(run_dir: Path) -> int:
    """The run's total data bytes sent, as its last ``metrics.jsonl`` row with them says."""
    return [r for r in metrics_rows(run_dir) if "comm/total_sent_bytes" in r][-1][
        "comm/total_sent_bytes"]


# Columns measured by a clock or by the machine (and the loader's queue depth, which depends on
# how far its producer got): they differ between any two runs. And the control flags' bytes
# (stop, checkpoint and loss agreement, in every kind's window sum too), which depend on how
# often a run was stopped: the run's total leaves them out for that reason.
MEASURED = re.compile(r"^(time|time/.*|step_time_s|tokens_per_s|mfu|mem/.*|data/queue|.*wait_s"
                      r"|comm/control_.*|comm/(sent|recv)_bytes)$")


def assert_same_record(a: Path, b: Path) -> None:
    """Two runs' ``metrics.jsonl`` hold the same rows in every column not measured by a clock or
    the machine (loss, lr, grad norm, tokens, bytes sent per kind and in total, optimizer and
    strategy metrics): what a resumed run must log as the uninterrupted one does."""
    rows_a, rows_b = metrics_rows(a), metrics_rows(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        keep_a = {k: v for k, v in ra.items() if not MEASURED.match(k)}
        keep_b = {k: v for k, v in rb.items() if not MEASURED.match(k)}
        diff = {k: (keep_a.get(k), keep_b.get(k)) for k in keep_a.keys() | keep_b.keys()
                if keep_a.get(k) != keep_b.get(k)}
        assert not diff, f"step {ra['step']}: {diff}"
