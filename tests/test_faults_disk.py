"""Storage faults through the real trainer: a full disk during a save, corrupted checkpoints.

The full disk is a real 4 MiB tmpfs (needs root and mount; skipped with the reason otherwise):
one checkpoint of the small job (~2.5 MB) fits, the second does not. Corruption is done to the
files on disk (flipped bytes, truncation, a broken manifest), then ``resume=auto`` must fall back
to the previous valid checkpoint with a warning and still end bit for bit where an uninterrupted
run ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import pytest

from scape_train.checkpoint import CheckpointError, CheckpointManager
from scape_train.train import run
from tests import _fault_job as fj
from tests.helpers import compose_config

JOB = ["trainer.max_steps=6", "trainer.keep_last=3"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return fj.tok_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("reference")
    run(compose_config(fj.overrides(run_dir, cache, *JOB, "trainer.checkpoint_every=0")))
    return fj.final_params(run_dir)


def job(run_dir, cache, *extra):
    return compose_config(fj.overrides(run_dir, cache, *JOB, *extra))


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_during_save_keeps_previous_and_resumes(tmp_path, cache, reference):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        run_dir = disk / "run"
        with pytest.raises(CheckpointError, match=r"step 2 .*No space left on device.*intact") as err:
            run(job(run_dir, cache, "trainer.checkpoint_every=1"))
        assert "resume=auto" in str(err.value)
        mgr = CheckpointManager(run_dir / "checkpoints", None)
        assert [p.name for p in mgr.list()] == ["step_00000001"]
        assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the partial save is removed
        first = mgr.list()[0]
        before = digests(first)
        CheckpointManager.verify(first)
        # More room (the operator frees space), then the same command with resume=auto.
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert digests(first) == before  # nothing was overwritten by the failed save
        summary = run(job(run_dir, cache, "trainer.checkpoint_every=1", "resume=auto"))
        assert summary["step"] == 6
        fj.assert_same_params(reference, fj.final_params(run_dir))


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00\xff\x00\xff")


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)


CORRUPTIONS = {
    "flipped_model": lambda c: _flip(c / "model.pt"),
    "truncated_rank_state": lambda c: _truncate(c / "rank_00000.pt"),
    "broken_manifest": lambda c: (c / "manifest.json").write_text('{"step": 4, "fil'),
    "missing_file": lambda c: (c / "rank_00000.pt").unlink(),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupted_newest_checkpoint_falls_back_end_to_end(tmp_path, cache, reference, caplog,
                                                           corruption):
    caplog.set_level(logging.INFO, logger="scape_train")
    first = run(job(tmp_path, cache, "trainer.checkpoint_every=2", "trainer.stop_after=4"))
    assert first["step"] == 4
    newest = tmp_path / "checkpoints" / "step_00000004"
    CORRUPTIONS[corruption](newest)
    summary = run(job(tmp_path, cache, "trainer.checkpoint_every=2", "resume=auto"))
    assert summary["step"] == 6
    assert "skipping checkpoint" in caplog.text and "step_00000004" in caplog.text
    assert "resumed from" in caplog.text and "step_00000002 at step 2" in caplog.text
    fj.assert_same_params(reference, fj.final_params(tmp_path))
    # The corrupted step 4 was written again, whole, over the bad one.
    CheckpointManager.verify(newest)
    assert not list((tmp_path / "checkpoints").glob("*.old"))
