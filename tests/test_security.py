"""Security basics: loading never runs pickled code; secrets in the environment stay out of files.

- A checkpoint whose ``model.pt`` pickles an arbitrary object (here one that would create a file
  when unpickled), with a matching checksum in the manifest, is refused by ``resume=auto`` and by
  the evaluation/export loader; the object's side effect never happens.
- Exports to Hugging Face format are safetensors only (no pickle files).
- A CLI run with W&B in offline mode and WANDB_API_KEY / HF_TOKEN set to sentinel values: no file
  in the run directory (config, metrics, checkpoints, W&B's offline files) and neither stdout nor
  stderr contains a sentinel.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from scape_train.checkpoint import CheckpointError, CheckpointManager
from scape_train.train import run
from tests import _fault_job as fj
from tests.helpers import compose_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return fj.tok_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache) -> Path:
    run_dir = tmp_path_factory.mktemp("trained")
    run(compose_config(fj.overrides(run_dir, cache, "trainer.max_steps=2")))
    return run_dir


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: a harmless stand-in for arbitrary code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(checkpoint: Path, name: str, obj) -> None:
    """Replace one file by a pickle of ``obj`` and fix its checksum, as an attacker would."""
    torch.save(obj, checkpoint / name)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["model.pt", "replicated.pt", "rank_00000.pt"])
def test_checkpoint_with_pickled_object_is_refused(tmp_path, cache, trained, name):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    ckpt = CheckpointManager(run_dir / "checkpoints", None).latest_valid()
    marker = tmp_path / "pwned"
    _plant(ckpt, name, {"weights": _Payload(str(marker))})
    CheckpointManager.verify(ckpt)  # the checksums match: only the loader stands in the way
    with pytest.raises(CheckpointError, match="refused to load"):
        run(compose_config(fj.overrides(run_dir, cache, "trainer.max_steps=4", "resume=auto")))
    assert not marker.exists()
    if name == "model.pt":  # the evaluation / export loader reads model.pt the same safe way
        from scape_train.eval.loading import load_checkpoint

        with pytest.raises((CheckpointError, pickle.UnpicklingError)):
            load_checkpoint(ckpt, device="cpu")
        assert not marker.exists()


def test_hf_export_is_safetensors_only(tmp_path, trained):
    from safetensors import safe_open

    from scape_train.export import export_checkpoint

    out = export_checkpoint(trained, tmp_path / "hf")
    names = sorted(p.name for p in Path(out).rglob("*") if p.is_file())
    assert "model.safetensors" in names, names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))], names
    with safe_open(str(Path(out) / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) > 0


def test_secrets_in_environment_never_written(tmp_path, cache):
    secrets = {"WANDB_API_KEY": "sentinel0wandb0" + "k" * 25, "HF_TOKEN": "hf_sentinel0token0xyz",
               "HUGGING_FACE_HUB_TOKEN": "hf_sentinel0hub0token"}
    env = fj.child_env(**secrets, WANDB_MODE="offline", WANDB_SILENT="true")
    run_dir = tmp_path / "run"
    cmd = fj.cli(run_dir, cache, "trainer.max_steps=3", "trainer.checkpoint_every=1",
                 "logging.wandb.mode=offline", "logging.progress_bar=true")
    proc = fj.launch(cmd, tmp_path / "logs" / "job", env)
    outcome = fj.kill_when(proc, lambda: False)
    assert outcome.returncode == 0, fj.logs(proc)[-3000:]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    scanned = files + [tmp_path / "logs" / "job.out", tmp_path / "logs" / "job.err"]
    # The scan covers what a leak would reach: config, metrics, checkpoints and W&B's own files.
    for needed in ("config.yaml", "metrics.jsonl", "model.pt", "manifest.json"):
        assert any(p.name == needed for p in files), needed
    assert any("wandb" in p.parts for p in files), "W&B wrote no offline files to scan"
    leaks = [(str(p), key) for p in scanned for key, value in secrets.items()
             if value.encode() in p.read_bytes()]
    assert not leaks, leaks
