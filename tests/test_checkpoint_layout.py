"""Each piece of state written once: real 2- and 4-rank gloo saves of a small model with dense
AdamW and SCAPE (replicated and sharded), the bytes on disk against the accounting (the same
function the save uses, also run on meta-device strategies with an assumed world size), and loads
across world sizes and modes from the owners' shard files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from scape_train.checkpoint import CheckpointManager
from scape_train.checkpoint_layout import (REPLICATED_FILE, AccountingComm, StateParts,
                                           checkpoint_files, file_bytes,
                                           materialize_for_accounting, trainer_parts)
from scape_train.distributed import DistInfo
from scape_train.optim import build_optimizer
from scape_train.optim.config import OptimizerConfig
from scape_train.rng import get_rng_state

from ._dist import run_distributed
from ._optim_common import make, train_step

pytestmark = pytest.mark.dist

WIDTH = 512        # ~12k parameters: tensor bytes well above the per-file serialization overhead
CONFIGS = {
    "adamw": dict(name="adamw", lr=1e-2),
    "scape_rep": dict(name="scape", lr=1e-2, density=0.25, density_schedule="constant"),
    "scape_sh": dict(name="scape", lr=1e-2, density=0.25, density_schedule="constant",
                     sharded=True, partitioner="flat"),
}
PER_RANK_OPT_KEYS = {"adamw": set(), "scape_rep": {"rank", "world", "residual"},
                     "scape_sh": {"rank", "world", "residual"}}


def _cfg(name: str, **kw) -> OptimizerConfig:
    return OptimizerConfig(**{**CONFIGS[name], **kw})


def _data_state() -> dict:
    return {"cursor": {"epoch": 0, "shard": 0, "pos": 7}, "packer": {"tokens": torch.arange(5)}}


def _parts(strategy, step: int) -> StateParts:
    return trainer_parts(strategy.checkpoint_state(), data=_data_state(), rng=get_rng_state(),
                         train={"step": step, "tokens": 0, "nan_skips": 0, "wandb_run_id": None},
                         synchronous=True)


def _save(strategy, model, root: Path, rank: int, world: int, step: int = 3) -> None:
    parts = _parts(strategy, step)
    mgr = CheckpointManager(root, DistInfo(rank=rank, world_size=world))
    mgr.save(step, model.state_dict() if rank == 0 else None, parts.per_rank, {"world": world},
             replicated=parts.replicated if rank == 0 else None, sharded=parts.sharded)


def _full(strategy) -> dict:
    """The strategy's whole state in memory (a collective in sharded mode: every rank calls it)."""
    if strategy.cfg.name == "scape":
        full = strategy.reference.full_state()
        return {"momentum": full["momentum"],
                "e": full["residual"] + full.get("shared_residual", 0.0),
                "shared": full.get("shared_residual"), "mask": strategy.next_mask().clone()}
    return {n: {k: v.clone() for k, v in s.items()}
            for n, s in strategy.state_dict()["optimizer"]["state"].items()}


def _load(strategy, path: Path, rank: int, world: int) -> None:
    ckpt = CheckpointManager(path.parent, DistInfo(rank=rank, world_size=world)).open(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # residuals reset across world sizes: expected
        strategy.load_checkpoint_state(StateParts(replicated=ckpt.replicated["optimizer"],
                                                  per_rank=ckpt.per_rank["optimizer"]), ckpt.shards)


def _worker(rank, world, root, load_from):
    root = Path(root)
    out = {"full": {}, "loaded": {}}
    for name in CONFIGS:
        strategy, wrapped, model = make(_cfg(name), width=WIDTH)
        for t in range(1, 4):
            train_step(strategy, wrapped, t, rank)
        _save(strategy, model, root / f"w{world}" / name, rank, world)
        out["full"][name] = _full(strategy)
        strategy.close()
    if load_from:   # the 2-rank checkpoints, loaded here into other world sizes and modes
        for saved, into in [("scape_sh", "scape_sh"), ("scape_sh", "scape_rep"),
                            ("scape_rep", "scape_sh"), ("adamw", "adamw")]:
            path = CheckpointManager(Path(load_from) / saved, None).latest_valid()
            strategy, _, _ = make(_cfg(into), seed=7, width=WIDTH)
            _load(strategy, path, rank, world)
            out["loaded"][f"{saved}->{into}"] = _full(strategy)
            strategy.close()
    return out


def _files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.suffix == ".pt"}


def _overhead_bound(obj) -> int:
    """What serialization adds to the tensor bytes: the pickled structure and, per storage, a zip
    entry (local header, central directory entry, up to 63 bytes of alignment)."""
    n = [0]

    def walk(o):
        if isinstance(o, torch.Tensor):
            n[0] += 1
        elif isinstance(o, dict):
            n[0] += 1
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(obj)
    return 4096 + 512 * n[0]


def _meta_accounting(name: str, world: int, rank: int) -> dict[str, int]:
    """The same accounting on a meta-device replica, for an assumed world size and rank."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(12, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh(),
                              nn.Linear(WIDTH, 10))
    strategy = build_optimizer(_cfg(name), model, AccountingComm(world, rank))
    materialize_for_accounting(strategy)
    return file_bytes(checkpoint_files(rank, model_state=model.state_dict(),
                                       parts=_parts(strategy, 3)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    two = run_distributed(_worker, 2, (str(root), None))
    four = run_distributed(_worker, 4, (str(root), str(root / "w2")))
    return root, {2: two, 4: four}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_replicated_state_written_once_and_per_rank_files_hold_only_per_rank_pieces(saved, name):
    root, _ = saved
    shared_disk, shared_accounted, per_rank = {}, {}, {}
    for world in (2, 4):
        path = CheckpointManager(root / f"w{world}" / name, None).latest_valid()
        manifest = json.loads((path / "manifest.json").read_text())
        sizes = _files(path)
        assert set(sizes) == set(manifest["bytes"]) == set(manifest["files"])
        ranks = [f for f in sizes if f.startswith("rank_")]
        shards = [f for f in sizes if f.startswith("shard_")]
        assert len(ranks) == world and REPLICATED_FILE in sizes and "model.pt" in sizes
        assert bool(shards) == (name == "scape_sh")
        if shards:   # every owner wrote its own range, and nothing else
            ranges = sorted((e["lo"], e["hi"]) for e in manifest["shards"].values())
            assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert ranges[-1][1] == next(iter(manifest["shards"].values()))["total"]
        for f in ranks:
            state = torch.load(path / f, weights_only=True)
            assert set(state) == {"optimizer", "data", "rng"}, f
            assert set(state["optimizer"]) == PER_RANK_OPT_KEYS[name], f
        per_rank[world] = {manifest["bytes"][f] for f in ranks}
        shared_disk[world] = sum(v for f, v in sizes.items() if f not in ranks)
        shared_accounted[world] = sum(v for f, v in manifest["bytes"].items() if f not in ranks)
    # replicated and owner-sharded bytes do not grow with the world size ...
    assert shared_accounted[2] == shared_accounted[4]
    assert abs(shared_disk[2] - shared_disk[4]) <= 3 * 8192
    # ... and every rank's own piece is the same size, whatever the world size
    assert len(per_rank[2] | per_rank[4]) == 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accounting_equals_bytes_on_disk_and_runs_on_meta(saved, name):
    root, _ = saved
    for world in (2, 4):
        path = CheckpointManager(root / f"w{world}" / name, None).latest_valid()
        manifest = json.loads((path / "manifest.json").read_text())
        for f, size in _files(path).items():
            accounted = manifest["bytes"][f]
            bound = _overhead_bound(torch.load(path / f, weights_only=True))
            assert 0 <= size - accounted <= bound, (world, f, size, accounted, bound)
        # the accounting of meta-device strategies built for (world, rank) without a group
        meta = {}
        for rank in range(world):
            meta.update(_meta_accounting(name, world, rank))
        assert meta == manifest["bytes"], (world, name)


def test_loads_reshard_across_world_sizes_and_modes(saved):
    _, results = saved
    two, four = results[2], results[4]
    ref = two[0]["full"]
    for rank, res in enumerate(four):
        for key, got in res["loaded"].items():
            saved_as, into = key.split("->")
            want = ref[saved_as]
            if saved_as == "adamw":
                assert got.keys() == want.keys()
                assert all(torch.equal(got[n][k], want[n][k]) for n in want for k in want[n])
                continue
            assert torch.equal(got["momentum"], want["momentum"]), key
            assert torch.equal(got["mask"], want["mask"]), key
            # another world size: the per-rank residual is reset; a sharded checkpoint's shared
            # part rho survives (into e = rho + 0 in replicated mode, rho itself when sharded)
            if saved_as == "scape_sh":
                assert torch.equal(got["e"], want["shared"]), key
            else:
                assert torch.equal(got["e"], torch.zeros_like(got["e"])), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoint_of_the_earlier_layout_still_loads(tmp_path, name):
    """Before: every rank's file held its full state (``state_dict()``), no replicated file."""
    strategy, wrapped, model = make(_cfg(name), width=32)
    for t in range(1, 4):
        train_step(strategy, wrapped, t, 0)
    mgr = CheckpointManager(tmp_path, DistInfo())
    mgr.save(3, model.state_dict(), {"optimizer": strategy.state_dict(), "data": _data_state(),
                                     "rng": get_rng_state(), "train": {"step": 3}}, {})
    ckpt = mgr.open(mgr.latest_valid())
    assert ckpt.replicated == {} and not (mgr.latest_valid() / REPLICATED_FILE).exists()
    other, _, _ = make(_cfg(name), seed=5, width=32)
    other.load_checkpoint_state(StateParts(replicated=ckpt.replicated.get("optimizer", {}),
                                           per_rank=ckpt.per_rank["optimizer"]), ckpt.shards)
    a, b = strategy.state_dict(), other.state_dict()

    def same(x, y):
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert same(a, b)


def test_a_corrupted_shard_is_refused_when_read(saved, tmp_path):
    import shutil

    from scape_train.checkpoint import CheckpointError

    root, _ = saved
    src = CheckpointManager(root / "w4" / "scape_sh", None).latest_valid()
    path = tmp_path / src.name
    shutil.copytree(src, path)
    with open(path / "shard_00002.pt", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\xff\x00\xff")
    strategy, _, _ = make(_cfg("scape_sh"), width=WIDTH)    # one process: reads every shard
    with pytest.raises(CheckpointError, match="shard_00002.pt does not match its checksum"):
        _load(strategy, path, 0, 1)
    assert CheckpointManager(tmp_path, None).latest_valid() is None   # and is skipped as a whole
