import json
import os

import pytest
import torch

from scape_train.checkpoint import CheckpointError, CheckpointManager
from scape_train.distributed import DistInfo
from tests._dist import run_distributed


def _save(mgr, step, value):
    return mgr.save(step, {"w": torch.full((4,), float(value))},
                    {"optimizer": {"m": torch.tensor([value])}, "data": {"pos": step}}, {"tag": value})


def test_save_load_roundtrip_and_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, DistInfo(), keep_last=2)
    for step in (10, 20, 30):
        _save(mgr, step, step)
    assert [p.name for p in mgr.list()] == ["step_00000020", "step_00000030"]
    manifest, model, rank = mgr.load(mgr.latest_valid())
    assert manifest["step"] == 30 and manifest["meta"] == {"tag": 30}
    assert torch.equal(model["w"], torch.full((4,), 30.0))
    assert rank["data"] == {"pos": 30} and rank["resharded"] is False


def test_corrupted_checkpoint_falls_back_to_previous(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, DistInfo(), keep_last=3)
    _save(mgr, 1, 1)
    newest = _save(mgr, 2, 2)
    with open(newest / "model.pt", "r+b") as f:  # flip bytes in the middle of the file
        f.seek(os.path.getsize(newest / "model.pt") // 2)
        f.write(b"\x00\xff\x00\xff")
    with pytest.raises(CheckpointError, match="checksum"):
        CheckpointManager.verify(newest)
    assert mgr.latest_valid().name == "step_00000001"
    assert "corrupted" in caplog.text


def test_truncated_file_and_missing_manifest(tmp_path):
    mgr = CheckpointManager(tmp_path, DistInfo(), keep_last=3)
    _save(mgr, 1, 1)
    second = _save(mgr, 2, 2)
    with open(second / "rank_00000.pt", "r+b") as f:
        f.truncate(10)
    assert mgr.latest_valid().name == "step_00000001"
    (second / "manifest.json").write_text("{not json")
    assert mgr.latest_valid().name == "step_00000001"


def test_interrupted_save_leaves_previous_intact(tmp_path):
    mgr = CheckpointManager(tmp_path, DistInfo(), keep_last=3)
    _save(mgr, 1, 1)
    # A crash mid-save leaves only a .tmp directory; it is neither listed nor loaded.
    (tmp_path / "step_00000002.tmp").mkdir()
    (tmp_path / "step_00000002.tmp" / "model.pt.partial").write_bytes(b"half")
    assert mgr.latest_valid().name == "step_00000001"
    _save(mgr, 3, 3)  # the next save removes the leftover
    assert not (tmp_path / "step_00000002.tmp").exists()


def test_failed_write_raises_clear_error_and_keeps_previous(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, DistInfo(), keep_last=3)
    _save(mgr, 1, 1)
    import scape_train.checkpoint as ck

    real = ck.torch.save

    def disk_full(obj, f, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", disk_full)
    with pytest.raises(CheckpointError, match="previous checkpoints are intact"):
        _save(mgr, 2, 2)
    monkeypatch.setattr(ck.torch, "save", real)
    assert [p.name for p in mgr.list()] == ["step_00000001"]
    assert not list(tmp_path.glob("*.tmp"))
    json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())


def _save_multirank(rank, world, root):
    info = DistInfo(rank=rank, world_size=world)
    mgr = CheckpointManager(root, info, keep_last=2)
    mgr.save(5, {"w": torch.ones(2)} if rank == 0 else None,
             {"optimizer": {"r": torch.tensor([rank])}}, {"world": world})
    _, _, state = mgr.load(mgr.latest_valid())
    return int(state["optimizer"]["r"])


def test_multirank_save_each_rank_reads_its_own(tmp_path):
    assert run_distributed(_save_multirank, 3, (str(tmp_path),)) == [0, 1, 2]
    # a world of 2 reading a checkpoint of 3: each rank r < 3 reads rank r, flagged as resharded
    mgr = CheckpointManager(tmp_path, DistInfo(rank=1, world_size=2))
    _, _, state = mgr.load(mgr.latest_valid())
    assert int(state["optimizer"]["r"]) == 1 and state["resharded"]


def _agreed_worker(rank, world, root):
    import scape_train.checkpoint as ck
    from scape_train.distributed import init_distributed

    mgr = CheckpointManager(root, init_distributed("cpu"), keep_last=3)
    _save(mgr, 1, 1)
    newest = _save(mgr, 2, 2)
    mgr.info.comm.barrier()
    if rank == 1:   # a per-rank file only rank 1 reads
        with open(newest / "rank_00001.pt", "r+b") as f:
            f.truncate(10)
    mgr.info.comm.barrier()
    hashed = []
    real = ck._sha256
    ck._sha256 = lambda p: hashed.append(p.name) or real(p)
    try:
        chosen = mgr.latest_valid_agreed()
    finally:
        ck._sha256 = real
    return chosen.name, sorted(set(hashed))


def test_resume_choice_is_agreed_and_each_rank_hashes_only_its_reads(tmp_path):
    (r0, h0), (r1, h1) = run_distributed(_agreed_worker, 2, (str(tmp_path),))
    assert r0 == r1 == "step_00000001"      # rank 1's broken file makes both fall back
    assert "rank_00001.pt" not in h0 and "rank_00000.pt" not in h1
