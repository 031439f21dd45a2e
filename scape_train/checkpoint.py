"""One checkpoint manager for everything that must survive a restart.

Layout of one checkpoint (``<run_dir>/checkpoints/step_00000200/``); each piece of state is
written once, by the rank that holds it (``checkpoint_layout.py`` says which is which):

    model.pt            rank 0: the model's state_dict (model space, unwrapped)
    replicated.pt       rank 0: state identical on every rank (dense optimizer state, SCAPE's
                        replicated momentum and masks, the train counters)
    shard_00003.pt ...  each owner of owner-sharded state (SCAPE sharded m, ρ): its flat range
    rank_00000.pt ...   every rank: its own state (residuals, data cursor, RNG states)
    manifest.json       rank 0, written last: step, world size, metadata, sha256 of every file,
                        each shard's flat range, the accounted tensor bytes of every file

A save is atomic: ranks write into ``step_X.tmp`` and hash their own files; only when every
rank's files are written (agreed by a collective) does rank 0 collect the digests, write the
manifest and rename the directory. A crash or a full disk at any point leaves the previous
checkpoints untouched and at worst a ``.tmp`` directory that the next save removes. Loads verify
the manifest's checksums and use ``torch.load(weights_only=True)``; a corrupted checkpoint is
skipped with a warning in favour of the previous valid one. Tensors are written from where they
live (``torch.save`` copies each storage to the host as it writes it), so loaders pass
``map_location``. Checkpoints without a replicated file (everything in the rank files) load too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scape_train.checkpoint_layout import (MODEL_FILE, REPLICATED_FILE, FlatShard, StateParts,
                                           assemble_range, checkpoint_files, file_bytes, rank_file,
                                           shard_file)
from scape_train.distributed import DistInfo, barrier

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 2          # 1 (no "format" key): every rank's file held its full state


class CheckpointError(RuntimeError):
    pass



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


def _load_tensors(path: Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never code.
    ``mmap``: tensors map the file, so only the slices used are read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain containers; refused to load it "
            f"(weights_only=True), since unpickling them could run code. Only resume from "
            f"checkpoints this trainer wrote. ({str(exc).splitlines()[0]})") from exc


def _read_manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from exc


def _check_digest(path: Path, name: str, files: dict[str, str]) -> None:
    if name not in files:
        raise CheckpointError(f"{path}: the manifest lists no {name}")
    if _sha256(path / name) != files[name]:
        raise CheckpointError(f"{path}: {name} does not match its checksum (corrupted)")


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
    def save(self, step: int, model_state: dict | None, rank_state: dict, meta: dict, *,
             replicated: dict | None = None, sharded: FlatShard | None = None) -> Path:
        """Collective: every rank calls it. ``model_state`` and ``replicated`` are written by
        rank 0 only (other ranks may pass None), ``sharded`` by its owner, ``rank_state`` by
        each rank; :func:`checkpoint_files` decides the files."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        comm = self.info.comm
        error: BaseException | None = None
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier(self.info)
        parts = StateParts(replicated=replicated if replicated is not None else {},
                           per_rank=rank_state, sharded=sharded)
        files = checkpoint_files(self.info.rank, model_state=model_state, parts=parts)
        if replicated is None:
            files.pop(REPLICATED_FILE, None)
        report: dict[str, Any] = {"files": {}, "bytes": file_bytes(files), "shards": {}}
        if sharded is not None and sharded.numel:
            report["shards"][shard_file(self.info.rank)] = {
                "lo": sharded.lo, "hi": sharded.hi, "total": sharded.total,
                "tensors": sorted(sharded.tensors)}
        try:
            for name, obj in files.items():
                _atomic_torch_save(obj, tmp / name)
                report["files"][name] = _sha256(tmp / name)   # each rank hashes its own files
        except (OSError, RuntimeError) as exc:  # disk full, permissions: previous ones stay intact
            # torch's zip writer turns ENOSPC into a RuntimeError ("unexpected pos") on close
            error = exc.__context__ if isinstance(exc.__context__, OSError) else exc
        if not comm.all_ok(error is None):
            if self.info.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"saving the checkpoint of step {step} into {self.root} failed"
                f"{f' ({error})' if error else ' on another rank'}; the previous checkpoints are "
                "intact. Free disk space or point run_dir elsewhere, then resume=auto.") from error
        reports = comm.all_gather_object(report)
        if self.info.is_main:
            merged: dict[str, dict] = {"files": {}, "bytes": {}, "shards": {}}
            for r in reports:
                for key in merged:
                    merged[key].update(r[key])
            manifest = {"format": FORMAT, "step": step, "world_size": self.info.world_size,
                        "files": dict(sorted(merged["files"].items())),
                        "bytes": dict(sorted(merged["bytes"].items())),
                        "shards": dict(sorted(merged["shards"].items())), "meta": meta}
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
    def verify(path: Path, names: list[str] | None = None) -> dict:
        """The manifest of a checkpoint whose files all exist and match their checksums (only
        ``names`` are hashed when given); raises otherwise."""
        path = Path(path)
        manifest = _read_manifest(path)
        files = manifest.get("files", {})
        for name in files:
            if not (path / name).exists():
                raise CheckpointError(f"{path}: missing {name}")
        for name in files if names is None else names:
            _check_digest(path, name, files)
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

    def _reads(self, manifest: dict) -> list[str]:
        """The files this rank reads at load (shard files are hashed when first opened)."""
        files = manifest.get("files", {})
        src = self.info.rank if self.info.rank < manifest["world_size"] else 0
        return [n for n in (MODEL_FILE, REPLICATED_FILE, rank_file(src)) if n in files]

    def latest_valid_agreed(self) -> Path | None:
        """The newest checkpoint whose files verify on every rank, each rank hashing only the
        files it reads (at 64 ranks, every rank hashing every file would read the whole
        checkpoint 64 times); one ``all_ok`` per candidate agrees. The candidates are rank 0's
        list, so that ranks that list the directory at different moments (a save still landing)
        test the same checkpoint in the same round: one missing on a rank fails its check there.
        Collective."""
        names = self.info.comm.broadcast_object([p.name for p in self.list()])
        for path in (self.root / name for name in reversed(names)):
            ok = True
            try:
                self.verify(path, self._reads(_read_manifest(path)))
            except (OSError, ValueError, KeyError, CheckpointError) as exc:
                log.warning("skipping checkpoint %s on rank %d: %s", path, self.info.rank, exc)
                ok = False
            if self.info.comm.all_ok(ok):
                return path
            log.warning("checkpoint %s failed its checksums on some rank; trying the previous one",
                        path)
        return None

    def open(self, path: Path) -> "LoadedCheckpoint":
        """This rank's view of a checkpoint, checksums verified first: the model and the
        replicated part (every rank reads them), this rank's per-rank part and the owners'
        shards (read lazily, only the flat ranges asked for).

        With a different world size, rank r reads the saved rank r's file if it exists, else
        rank 0's; ``resharded`` tells the caller so it can reset per-rank parts.
        """
        path = Path(path)
        manifest = _read_manifest(path)
        files = manifest.get("files", {})
        saved_world = manifest["world_size"]
        src = self.info.rank if self.info.rank < saved_world else 0
        # Hash what this rank reads; shard files are hashed when first opened.
        self.verify(path, self._reads(manifest))
        if MODEL_FILE not in files or rank_file(src) not in files:
            raise CheckpointError(f"{path}: the manifest lists no {MODEL_FILE} or "
                                  f"{rank_file(src)}")
        model_state = _load_tensors(path / MODEL_FILE)
        replicated = _load_tensors(path / REPLICATED_FILE) if REPLICATED_FILE in files else {}
        per_rank = _load_tensors(path / rank_file(src))
        return LoadedCheckpoint(path, manifest, model_state, replicated, per_rank,
                                saved_world != self.info.world_size,
                                ShardReader(path, manifest.get("shards", {}), files))

    def load(self, path: Path) -> tuple[dict, dict, dict]:
        """(manifest, model_state, rank_state) for this rank: :meth:`open`'s per-rank part with
        ``rank_state['resharded']``."""
        ckpt = self.open(path)
        rank_state = dict(ckpt.per_rank)
        rank_state["resharded"] = ckpt.resharded
        return ckpt.manifest, ckpt.model, rank_state


class ShardReader:
    """The owner-sharded state of a checkpoint (a ``ShardSource``): any flat range of a sharded
    tensor, assembled from the owners' files that overlap it (memory-mapped: only the slices
    needed are read), whatever the world size and partition that wrote them."""

    def __init__(self, path: Path, entries: dict[str, dict], digests: dict[str, str]):
        self.path = Path(path)
        self.entries = sorted(entries.items(), key=lambda kv: kv[1]["lo"])
        self.digests = digests
        self._open: dict[str, dict] = {}

    def _tensors(self, name: str) -> dict:
        if name not in self._open:
            _check_digest(self.path, name, self.digests)
            data = _load_tensors(self.path / name, mmap=True)
            self._open[name] = data["tensors"]
        return self._open[name]

    def read(self, name: str, lo: int, hi: int, total: int) -> torch.Tensor | None:
        try:
            return assemble_range(((e["lo"], e["hi"], e["total"],
                                    lambda f=f: self._tensors(f)) for f, e in self.entries
                                   if name in e["tensors"]), name, lo, hi, total)
        except ValueError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from exc


@dataclass
class LoadedCheckpoint:
    path: Path
    manifest: dict
    model: dict
    replicated: dict          # rank 0's replicated part ({} where no replicated file was written)
    per_rank: dict            # this rank's part (rank 0's if this rank did not exist then)
    resharded: bool           # saved with another world size
    shards: ShardReader


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
