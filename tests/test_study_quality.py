"""scripts/study_quality.py (the convergence study): a tiny real run through torchrun, the
skip of finished runs, the paired-gap statistics, the report; and top-k's mask overlap metric."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from scape_train.optim.config import OptimizerConfig

from ._optim_common import batch, loss_fn, make

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("study_quality", REPO / "scripts" / "study_quality.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["study_quality"] = mod
    spec.loader.exec_module(mod)
    return mod


sq = _load()


# ------------------------------------------------------------------ top-k's mask overlap


def test_topk_mask_overlap_is_a_device_scalar_matching_the_selections():
    strategy, wrapped, _ = make(OptimizerConfig(name="topk_adamw", lr=1e-2, density=0.3,
                                                density_schedule="constant"))
    picks = []
    select = strategy._select
    strategy._select = lambda acc, d: picks.append(select(acc, d)) or picks[-1]
    for t in range(1, 4):
        strategy.before_forward(t)
        x, y = batch(t, 0)
        loss_fn(wrapped, x, y).backward()
        strategy.after_backward()
        m = strategy.step(1e-2)
        strategy.zero_grad()
        if t == 1:
            assert "topk/mask_overlap" not in m      # no previous selection yet
            continue
        ov = m["topk/mask_overlap"]
        assert isinstance(ov, torch.Tensor) and ov.dim() == 0   # no host sync in the step
        now, prev = set(picks[-1].tolist()), set(picks[-2].tolist())
        assert ov.item() == pytest.approx(len(now & prev) / len(now))
        assert 0.0 < ov.item() <= 1.0
    # a load forgets the previous selection: the next step logs no overlap
    strategy.load_state_dict(strategy.state_dict())
    assert strategy._prev_mask is None


# ------------------------------------------------------------------ statistics


def test_t_quantile_and_paired_gap_on_synthetic_numbers():
    # table values of the two-sided 95% t quantile
    for df, q in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)]:
        assert sq.t_quantile(0.975, df) == pytest.approx(q, abs=2e-4)
    scape = {0: 5.10, 1: 5.20, 2: 5.05}
    adams = {0: 5.00, 1: 5.15, 2: 5.05, 3: 9.9}     # seed 3 unpaired: ignored
    g = sq.paired_gap(scape, adams)
    d = [0.10, 0.05, 0.0]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = 4.302653 * sd / math.sqrt(3)
    assert g["n"] == 3 and g["seeds"] == [0, 1, 2]
    assert g["mean"] == pytest.approx(0.05) and g["sd"] == pytest.approx(sd)
    assert g["lo"] == pytest.approx(mean - half, abs=1e-5)
    assert g["hi"] == pytest.approx(mean + half, abs=1e-5)
    assert sq.paired_gap({0: 1.0}, {0: 0.5})["lo"] is None   # one pair: no interval
    assert sq.paired_gap({0: 1.0}, {1: 0.5}) is None
    # the statement: "yes" only when the whole interval is within the margin
    tight = {"n": 3, "mean": 0.01, "sd": 0.001, "lo": 0.005, "hi": 0.015}
    wide = {"n": 3, "mean": 0.01, "sd": 0.02, "lo": -0.04, "hi": 0.06}
    assert ": yes, gap +0.0100 [+0.0050, +0.0150] over 3 seeds" in sq.statement("scape90", 1000, tight)
    assert ": no (the mean is within the margin" in sq.statement("scape90", 1000, wide)
    assert ": yes" in sq.statement("scape99", 1000, wide | {"hi": 0.039})


def _fake(opt, lr, seed, steps, loss, stage):
    curve = [[steps // 2, loss + 0.5], [steps, loss]]
    return {"id": sq.Run(opt, lr, seed, steps, stage).id, "optimizer": opt, "label": sq.OPTIMIZERS[opt].label,
            "lr": lr, "seed": seed, "steps": steps, "stage": stage, "density": sq.OPTIMIZERS[opt].density,
            "payload_dtype": None, "mask_coding": None, "final_val_loss": loss, "val_loss": curve,
            "train_loss": curve, "residual_norm": [[1, 0.5], [steps, 1.0]] if opt != "adams" else [],
            "mask_overlap": [[2, 0.8], [steps, 0.9]] if opt != "adams" else [], "density_series": [],
            "tokens": 1, "wall_s": 100.0, "command": "x", "finished_at": "now", "commit": "0123abc",
            "dirty": False}


def test_plan_stages_best_lr_edge_extension_and_report(tmp_path):
    s = sq.Settings(optimizers=("adams", "scape99", "scape99_bf16"), horizons=(300, 1000, 3000),
                    horizon_optimizers=("adams", "scape99"))
    planned = sq.plan({}, s)
    stages = [r.stage for r, _ in planned]
    assert stages.count("sweep") == 6 and all(ok for r, ok in planned if r.stage == "sweep")
    assert not any(ok for r, ok in planned if r.stage != "sweep")     # wait for the sweep
    assert stages.count("seeds") == 2 * 2 + 3 and stages.count("horizons") == 2 * 2 * 3
    # finished sweeps: adams' best is in the middle, scape99's at the top edge -> one more lr
    res = {}
    rng = random.Random(0)
    for lr, a, b in [(1e-3, 5.3, 5.5), (2e-3, 5.1, 5.3), (4e-3, 5.2, 5.2)]:
        for r in (_fake("adams", lr, 0, 1000, a, "sweep"), _fake("scape99", lr, 0, 1000, b, "sweep")):
            res[r["id"]] = r
    res["scape99_lr0.001_s0_h1000"].update(final_val_loss=None, diverged=True)   # diverged: last
    assert sq.best_lr(res, "adams", s) == 2e-3
    assert sq.sweep_lrs(res, "scape99", s) == [1e-3, 2e-3, 4e-3, 8e-3]
    assert sq.best_lr(res, "scape99", s) is None                       # its sweep is not finished
    r = _fake("scape99", 8e-3, 0, 1000, 5.25, "sweep")
    res[r["id"]] = r
    assert sq.best_lr(res, "scape99", s) == 4e-3 == sq.best_lr(res, "scape99_bf16", s)
    assert sq.sweep_lrs(res, "scape99", s) == [1e-3, 2e-3, 4e-3, 8e-3]   # extended once only
    # seeds and horizons at the best lr, paired by seed
    for steps in (300, 1000, 3000):
        for seed in range(3):
            for opt, lr, base in (("adams", 2e-3, 5.1), ("scape99", 4e-3, 5.2)):
                if steps == 1000 and seed == 0:
                    continue
                r = _fake(opt, lr, seed, steps, base + 0.01 * rng.random() - 0.001 * math.log(steps),
                          "seeds" if steps == 1000 else "horizons")
                res[r["id"]] = r
    planned = sq.plan(res, s)
    assert all(ok for _, ok in planned)
    summary = sq.summarize(res, s)
    g = summary["gaps"]["scape99"][1000]
    want = sq.paired_gap(sq.finals(res, "scape99", 1000, 4e-3), sq.finals(res, "adams", 1000, 2e-3))
    assert g == {**want, "commit": "0123abc"} and g["n"] == 3
    assert sorted(summary["gaps"]["scape99"]) == [300, 1000, 3000]
    report = tmp_path / "quality.md"
    report.write_text("# Quality\n\nhand-written part\n")
    payload = sq.write_outputs(res, s, planned, 3600.0, tmp_path / "figures" / "quality_study.json", report)
    text = report.read_text()
    assert text.startswith("# Quality\n\nhand-written part\n") and text.count(sq.BEGIN) == 1
    assert "99% sparsity: SCAPE matches dense AdamS within the paper's margins (0.02 at 90%, 0.04 at 99%) at horizon 3000: no, gap +0." in text           # ~0.1 worse than AdamS
    assert "SCAPE-99 | 4e-3 |" not in text and "| SCAPE-99 | 0.004 | 3 |" in text
    assert "| SCAPE-99 | 0.01 | 1 | 1 | 1 | 0.9 |" in text              # the mechanisms table
    assert "| SCAPE-99 | 0.001: diverged, 0.002: 5.3000, 0.004: 5.2000, 0.008: 5.2500 |" in text
    for name in ("quality_study_curves.png", "quality_study_gap.png", "quality_study_mechanisms.png"):
        assert (tmp_path / "figures" / name).stat().st_size > 0
    assert payload["summary"]["best_lr"]["scape99"] == 4e-3
    sq.write_outputs(res, s, planned, 3600.0, tmp_path / "figures" / "quality_study.json", report)
    assert report.read_text() == text                               # regenerating replaces


def test_pairing_refuses_runs_of_different_commits_or_none():
    a = [_fake("scape99", 4e-3, k, 1000, 5.2 + 0.01 * k, "seeds") for k in range(3)]
    b = [_fake("adams", 2e-3, k, 1000, 5.1 + 0.01 * k, "seeds") for k in range(3)]
    assert sq.paired(a, b, "x")["commit"] == "0123abc"
    b[1] = {**b[1], "commit": "fedcba9"}
    with pytest.raises(sq.MixedCommitsError) as err:
        sq.paired(a, b, "SCAPE-99 vs dense AdamS")
    msg = str(err.value)
    assert "different commits" in msg and "fedcba9: adams_lr0.002_s1_h1000" in msg
    assert "0123abc: " in msg and "scape99_lr0.004_s0_h1000" in msg
    # a seed that is not paired does not count; a dirty run is of other code than its commit
    assert sq.paired(a, b, "x", seeds=[0, 2])["n"] == 2
    a[0] = {**a[0], "dirty": True}
    with pytest.raises(sq.MixedCommitsError, match=r"0123abc\+dirty: scape99_lr0.004_s0_h1000"):
        sq.paired(a, b, "x", seeds=[0, 2])
    # a run without a recorded commit is refused, naming it and what to do
    none = {k: v for k, v in b[2].items() if k not in ("commit", "dirty")}
    with pytest.raises(sq.MixedCommitsError, match="record no commit: adams_lr0.002_s2_h1000.*"
                                                   "--unrecorded-commit"):
        sq.paired(a[1:], [b[0], none], "x")


def test_pairing_accepts_another_commit_only_where_a_run_records_the_evidence():
    a = [_fake("scape99", 4e-3, k, 1000, 5.2 + 0.01 * k, "seeds") for k in range(3)]
    b = [{**_fake("adams", 2e-3, k, 1000, 5.1 + 0.01 * k, "seeds"), "commit": "fedcba9"}
         for k in range(3)]
    with pytest.raises(sq.MixedCommitsError, match="different commits"):
        sq.paired(a, b, "x")
    proof = {"commit": "0123abc", "evidence": "40-step runs identical bit for bit"}
    b = [{**r, "same_training_as": [proof]} for r in b]
    g = sq.paired(a, b, "x")
    assert g["commit"] == "0123abc" and g["n"] == 3
    assert g["same_training"] == sorted(r["id"] for r in b)
    # the proof holds for the commit it names only, and not for a dirty run
    c = [{**r, "commit": "7777777"} for r in a]
    with pytest.raises(sq.MixedCommitsError, match="7777777: scape99"):
        sq.paired(c, b, "x")
    with pytest.raises(sq.MixedCommitsError):
        sq.paired([{**a[0], "dirty": True}], b, "x", seeds=[0])
    # a proof without its evidence is an error, not an acceptance
    b[0] = {**b[0], "same_training_as": [{"commit": "0123abc"}]}
    with pytest.raises(ValueError, match="evidence"):
        sq.paired(a, b, "x")
    # runs of one commit need no proof and record none
    assert "same_training" not in sq.paired(a, a, "x")


def test_runs_without_a_commit_take_the_one_their_json_names(tmp_path):
    run = {k: v for k, v in _fake("adams", 2e-3, 0, 1000, 5.1, "seeds").items()
           if k not in ("commit", "dirty")}
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"runs": [run]}))
    assert sq.json_runs(path)[run["id"]].get("commit") is None
    got = sq.json_runs(path, "abc1234")[run["id"]]
    assert (got["commit"], got["dirty"], got["commit_source"]) == ("abc1234", False, "json")
    path.write_text(json.dumps({"code_commit": "def5678", "runs": [run, {**run, "id": "r2",
                                                                         "commit": "9999999"}]}))
    runs = sq.json_runs(path)
    assert runs[run["id"]]["commit"] == "def5678" and runs["r2"]["commit"] == "9999999"


def test_code_state_names_the_commit_of_the_code():
    import subprocess

    state = sq.code_state()
    code = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%H", "HEAD", "--",
                           "scape_train", "scripts", "configs", "pyproject.toml"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert len(code) == 40 and state["commit"] == code and isinstance(state["dirty"], bool)


def test_report_without_data_says_not_run(tmp_path):
    s = sq.Settings()
    s2, planned, total = sq.apply_budget({}, s, 3.0)
    assert 2 * 3600 <= total <= 3 * 3600 and not s2.cuts                # the study's own estimate
    _, _, cut_total = sq.apply_budget({}, s, 1.5)
    report = tmp_path / "q.md"
    sq.write_outputs({}, s2, planned, total, tmp_path / "q.json", report)
    text = report.read_text()
    assert "The study has not been run yet" in text
    assert ".venv/bin/python scripts/study_quality.py" in text
    assert json.loads((tmp_path / "q.json").read_text())["runs"] == []
    assert cut_total < total


# ------------------------------------------------------------------ a real tiny run


@pytest.mark.dist
@pytest.mark.slow
def test_tiny_study_runs_two_optimizers_and_skips_finished_runs(tmp_path, capsys, monkeypatch):
    args = ["--shape", "tiny", "--ranks", "2", "--main-horizon", "2", "--horizons", "2",
            "--seeds", "1", "--lrs", "0.003", "--optimizers", "adams", "scape99",
            "--out-dir", str(tmp_path / "out"), "--json", str(tmp_path / "docs" / "figures" / "q.json"),
            "--report", str(tmp_path / "docs" / "quality.md"),
            "--extra", f"data.tokenizer.cache_dir={tmp_path / 'tok'}"]
    assert sq.main(args) == 0
    out = capsys.readouterr().out
    assert "ran 2 runs" in out
    data = json.loads((tmp_path / "docs" / "figures" / "q.json").read_text())
    runs = {r["optimizer"]: r for r in data["runs"]}
    assert set(runs) == {"adams", "scape99"}
    for r in runs.values():
        for key in ("optimizer", "lr", "seed", "steps", "density", "payload_dtype", "mask_coding",
                    "final_val_loss", "val_loss", "residual_norm", "mask_overlap", "wall_s", "command"):
            assert key in r, key
        assert r["steps"] == 2 and r["lr"] == 0.003 and r["seed"] == 0
        assert math.isfinite(r["final_val_loss"]) and r["val_loss"][-1] == [2, r["final_val_loss"]]
        assert r["wall_s"] > 0 and "--nproc_per_node=2" in r["command"]
    sc = runs["scape99"]
    assert sc["density"] == 0.01 and sc["payload_dtype"] == "fp32" and sc["mask_coding"] == "auto"
    assert [s for s, _ in sc["residual_norm"]] == [1, 2] and [s for s, _ in sc["mask_overlap"]] == [2]
    assert runs["adams"]["residual_norm"] == [] and runs["adams"]["density"] is None
    assert not (tmp_path / "out" / "runs" / sc["id"] / "train" / "checkpoints").exists()
    text = (tmp_path / "docs" / "quality.md").read_text()
    assert "Runs finished: 2 of 2 planned" in text and "99% sparsity: SCAPE" in text and "at horizon 2: no (one paired seed" in text
    # a second invocation runs nothing
    stamp = (tmp_path / "out" / "runs" / sc["id"] / "result.json").stat().st_mtime_ns
    assert sq.main(args) == 0
    out = capsys.readouterr().out
    assert "2 finished" in out and "ran 0 runs" in out
    assert (tmp_path / "out" / "runs" / sc["id"] / "result.json").stat().st_mtime_ns == stamp
    # a diverging run (non-finite loss at step 2: the trainer stops) is a result, not a failure
    monkeypatch.setenv("SCAPE_FAULT_NAN_STEPS", "2")
    i = args.index("--optimizers")
    assert sq.main(args[:i + 1] + ["topk99"] + args[i + 1:]) == 0
    out = capsys.readouterr().out
    assert "ran 1 runs" in out and "diverged" in out
    data = json.loads((tmp_path / "docs" / "figures" / "q.json").read_text())
    tk = next(r for r in data["runs"] if r["optimizer"] == "topk99")
    assert tk["diverged"] and tk["final_val_loss"] is None and tk["residual_norm"][0][0] == 1
    assert "top-k AdamW 99% | 0.003: diverged" in (tmp_path / "docs" / "quality.md").read_text()


def test_one_invocation_at_a_time(tmp_path):
    import fcntl

    args = ["--report-only", "--out-dir", str(tmp_path / "out"), "--json", str(tmp_path / "q.json"),
            "--report", str(tmp_path / "q.md")]
    (tmp_path / "out" / "runs").mkdir(parents=True)
    with open(tmp_path / "out" / "runs" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert sq.main(args) == 1 and not (tmp_path / "q.md").exists()
    assert sq.main(args) == 0 and "has not been run yet" in (tmp_path / "q.md").read_text()
