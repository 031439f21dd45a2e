"""One checkpoint manager for everything that must survive a restart.

Layout of one checkpoint (``<run_dir>/checkpoints/step_00000200/``):

    model.pt            rank 0: the model's state_dict (model space, unwrapped)
    rank_00000.pt ...   every rank: optimizer strategy, data cursor, RNG states
    manifest.json       rank 0, written last: step, world size, metadata, sha256 of every file

A save is atomic: ranks write into ``step_X.tmp``; only when every rank's files are written
(agreed by a collective) does rank 0 hash them, write the manifest and rename the directory. A
crash or a full disk at any point leaves the previous checkpoints untouched and at worst a
``.tmp`` directory that the next save removes. Loads verify the manifest's checksums and use
``torch.load(weights_only=True)``; a corrupted checkpoint is skipped with a warning in favour of
the previous valid one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from scape_train.distributed import DistInfo, barrier

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MODEL_FILE = "model.pt"


class CheckpointError(RuntimeError):
    pass


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain containers; refused to load it "
            f"(weights_only=True), since unpickling them could run code. Only resume from "
            f"checkpoints this trainer wrote. ({str(exc).splitlines()[0]})") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    def __init__(self, root: Path, info: DistInfo, keep_last: int = 3):
        self.root, self.info, self.keep_last = Path(root), info, keep_last

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, model_state: dict | None, rank_state: dict, meta: dict) -> Path:
        """Collective: every rank calls it. ``model_state`` is only needed on rank 0."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        error: BaseException | None = None
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier(self.info)
        try:
            if self.info.is_main:
                _atomic_torch_save(model_state, tmp / MODEL_FILE)
            _atomic_torch_save(rank_state, tmp / _rank_file(self.info.rank))
        except (OSError, RuntimeError) as exc:  # disk full, permissions: previous ones stay intact
            # torch's zip writer turns ENOSPC into a RuntimeError ("unexpected pos") on close
            error = exc.__context__ if isinstance(exc.__context__, OSError) else exc
        if not self.info.comm.all_ok(error is None):
            if self.info.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"saving the checkpoint of step {step} into {self.root} failed"
                f"{f' ({error})' if error else ' on another rank'}; the previous checkpoints are "
                "intact. Free disk space or point run_dir elsewhere, then resume=auto.") from error
        if self.info.is_main:
            files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
            manifest = {"step": step, "world_size": self.info.world_size, "files": files, "meta": meta}
            part = tmp / (MANIFEST + ".partial")
            try:
                with open(part, "w") as f:
                    json.dump(manifest, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:  # the disk filled up just now: same promise as above
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(
                    f"writing the manifest of step {step} into {self.root} failed ({exc}); the "
                    "previous checkpoints are intact. Free disk space, then resume=auto.") from exc
            os.replace(part, tmp / MANIFEST)
            old = None
            if final.exists():  # re-saving a step (e.g. after a resume): swap atomically
                old = final.with_name(final.name + ".old")
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._prune()
        barrier(self.info)
        return final

    def _prune(self) -> None:
        done = self.list()
        for path in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)

    # -- finding and loading ---------------------------------------------------------------
    def list(self) -> list[Path]:
        """Completed checkpoints (with a manifest), oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*")
                      if p.is_dir() and p.suffix == "" and (p / MANIFEST).exists())

    @staticmethod
    def verify(path: Path) -> dict:
        """The manifest of a checkpoint whose files all match their checksums; raises otherwise."""
        path = Path(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable manifest ({exc})") from exc
        for name, digest in manifest.get("files", {}).items():
            f = path / name
            if not f.exists():
                raise CheckpointError(f"{path}: missing {name}")
            if _sha256(f) != digest:
                raise CheckpointError(f"{path}: {name} does not match its checksum (corrupted)")
        return manifest

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; corrupted ones are skipped with a warning."""
        for path in reversed(self.list()):
            try:
                self.verify(path)
                return path
            except CheckpointError as exc:
                log.warning("skipping checkpoint: %s; trying the previous one", exc)
        return None

    def load(self, path: Path) -> tuple[dict, dict, dict]:
        """(manifest, model_state, rank_state) for this rank, checksums verified first.

        With a different world size, rank r reads the saved rank r's file if it exists, else
        rank 0's; ``rank_state['resharded']`` tells the caller so it can reset per-rank parts.
        """
        path = Path(path)
        manifest = self.verify(path)
        model_state = _load_tensors(path / MODEL_FILE)
        saved_world = manifest["world_size"]
        src = self.info.rank if self.info.rank < saved_world else 0
        rank_state = _load_tensors(path / _rank_file(src))
        rank_state["resharded"] = saved_world != self.info.world_size
        return manifest, model_state, rank_state


def find_checkpoint(path: str | Path, what: str = "checkpoint") -> Path:
    """``path`` itself if it is a checkpoint directory, else the newest valid checkpoint of a run
    directory (``<path>/checkpoints``) or of a checkpoints directory. ``what`` names the option in
    the error (``checkpoint=``, ``resume=``)."""
    path = Path(path).expanduser().resolve()
    if (path / MANIFEST).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = CheckpointManager(root, DistInfo()).latest_valid()
    if found is None:
        raise CheckpointError(f"{what}={path}: no valid checkpoint there (expected a checkpoint "
                              "directory with manifest.json, or a run directory with checkpoints/)")
    return found
