"""Small shared helpers for tests: composing the real Hydra config."""

from __future__ import annotations

import json
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


def total_sent_bytes(run_dir: Path) -> int:
    """The run's total data bytes sent, as its last ``metrics.jsonl`` row with them says."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "comm/total_sent_bytes" in r][-1]["comm/total_sent_bytes"]
