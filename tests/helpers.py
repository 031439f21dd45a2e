"""Small shared helpers for tests: composing the real Hydra config."""

from __future__ import annotations

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
