"""``scripts/study_horizons.py``: the plan (tuning, then every horizon at the winner), the report
from records alone (gaps per horizon, tokens per parameter, the power-law fit and why none is
read), and a study run killed after a checkpoint that resumes to the uninterrupted final loss."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import study_horizons as sh  # noqa: E402

sq = sh.sq     # the study's own module (another test file may load its own copy)

COMMIT = "0123abc"
PARAMS, TOKENS = 1_000_000, 1000       # 1 token per parameter per 1000 steps


def _rec(setting: str, lr: float, seed: int, steps: int, loss: float, sent: int = 1000) -> dict:
    run = sh.HRun(setting, lr, seed, steps, "tune")
    return {"id": run.id("study"), "candidate": setting, "label": setting, "lr": lr, "seed": seed,
            "steps": steps, "shape": "study", "final_val_loss": loss, "diverged": False,
            "sent_bytes": sent, "val_loss": [[steps, loss]], "commit": COMMIT, "dirty": False}


def _tuned(results: dict, p: sh.Plan, best: dict[str, float]) -> None:
    for name in p.settings:
        for lr in sh.lr_grid(name, p.lr_factors):
            r = _rec(name, lr, 0, p.tune_steps, 5.0 - (0.1 if math.isclose(lr, best[name]) else 0))
            results[r["id"]] = r


def test_plan_tunes_first_then_runs_every_horizon_at_the_winner():
    p = sh.Plan(settings=("adams", "scape99", "f_fp8_e4m3_d10", "diloco_h30"))
    planned = sh.plan({}, p)
    tune = [r for r, ok in planned if r.stage == "tune"]
    assert len(tune) == 4 * 3 and all(ok for r, ok in planned if r.stage == "tune")
    assert not any(ok for r, ok in planned if r.stage == "horizons")
    assert {r.lr for r in tune if r.setting == "adams"} == {5e-4, 1e-3, 2e-3}
    results = {}
    centre = {name: sh.s99.CANDIDATES[name].lr for name in p.settings}
    _tuned(results, p, centre)
    planned = sh.plan(results, p)
    hz = [r for r, _ in planned if r.stage == "horizons"]
    assert all(ok for _, ok in planned)
    # 3 seeds x 3 horizons for AdamS and SCAPE-99, seed 0 for the recommended setting, less the
    # tuning's own 10000-step seed-0 runs; DiLoCo only at the tuning horizon
    assert len(hz) == 2 * (9 - 1) + (3 - 1) and not any(r.setting == "diloco_h30" for r in hz)
    assert {r.lr for r in hz if r.setting == "scape99"} == {centre["scape99"]}
    assert {(r.steps, r.seed) for r in hz if r.setting == "adams"} == \
        {(h, k) for h in (3000, 10000, 30000) for k in range(3)} - {(10000, 0)}
    # the study's estimate: many hours on 2 cores (a 30000-step run is about 40 minutes)
    assert 20 * 60 < sh.estimate_s(sh.HRun("adams", 1e-3, 0, 30000, "horizons")) < 90 * 60


def test_a_winner_at_the_grids_edge_extends_the_grid_before_any_horizon_runs():
    p = sh.Plan(settings=("adams",), max_extensions=2)
    results = {}

    def finish(lr: float, loss: float | None) -> None:
        r = _rec("adams", lr, 0, p.tune_steps, loss)
        results[r["id"]] = r

    def tune_lrs() -> set[float]:
        return {r.lr for r, _ in sh.plan(results, p) if r.stage == "tune"}

    for lr, loss in ((5e-4, 3.44), (1e-3, 3.48), (2e-3, 3.51)):   # the lowest lr wins
        finish(lr, loss)
    assert tune_lrs() == {2.5e-4, 5e-4, 1e-3, 2e-3}
    assert sh.tuned_lr(results, "adams", p) is None
    assert not any(ok for r, ok in sh.plan(results, p) if r.stage == "horizons")
    finish(2.5e-4, 3.46)                     # the neighbour below loses: 5e-4 is the winner
    assert sh.tuning(results, "adams", p) == ([2.5e-4, 5e-4, 1e-3, 2e-3], 5e-4, False)
    assert all(ok for r, ok in sh.plan(results, p) if r.stage == "horizons")
    assert {r.lr for r, _ in sh.plan(results, p) if r.stage == "horizons"} == {5e-4}
    finish(2.5e-4, 3.40)                     # it wins instead: one more below, then no more
    assert tune_lrs() == {1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3}
    finish(1.25e-4, 3.30)
    grid, best, at_edge = sh.tuning(results, "adams", p)
    assert (best, at_edge) == (1.25e-4, True) and len(grid) == 3 + p.max_extensions
    s = sh.horizon_summary(results, PARAMS, TOKENS, p)
    assert s["tune"]["adams"]["at_edge"] and len(s["tune"]["adams"]["losses"]) == 5
    assert "(at the grid's edge after its extensions)" in sh.render_horizons(s, "figures")
    assert "at most 2 per side" in sh.render_horizons(s, "figures")
    # the study's own rule goes further down before the edge is final: no winner until 6.25e-5
    wider = dataclasses.replace(p, max_extensions=sh.MAX_EXTENSIONS)
    assert sh.MAX_EXTENSIONS > 2 and sh.tuning(results, "adams", wider)[1:] == (None, False)
    assert 6.25e-5 in {r.lr for r, _ in sh.plan(results, wider) if r.stage == "tune"}
    # the highest lr winning extends upwards; a diverged run never wins
    results.clear()
    for lr, loss in ((5e-4, 3.6), (1e-3, 3.5), (2e-3, 3.4)):
        finish(lr, loss)
    finish(4e-3, None)
    assert sh.tuning(results, "adams", p)[1:] == (2e-3, False)


def test_drive_command_runs_the_next_ready_run_with_the_settings_grid():
    p = sh.Plan(settings=("adams",), horizons=(3000,))
    results = {}
    cmd = sh.drive_command(results, p, "py")
    assert cmd[:8] == ["py", "scripts/study_horizons.py", "--stage", "tune", "--settings", "adams",
                       "--max-runs", "1"]
    assert cmd[cmd.index("--lr-factors") + 1:cmd.index("--horizons")] == ["0.5", "1.0", "2.0"]
    for lr, loss in ((5e-4, 3.44), (1e-3, 3.48), (2e-3, 3.51)):       # the edge wins: extend
        r = _rec("adams", lr, 0, p.tune_steps, loss)
        results[r["id"]] = r
    cmd = sh.drive_command(results, p, "py")
    assert cmd[cmd.index("--lr-factors") + 1:cmd.index("--horizons")] == ["0.25", "0.5", "1.0",
                                                                           "2.0"]
    r = _rec("adams", 2.5e-4, 0, p.tune_steps, 3.46)
    results[r["id"]] = r
    cmd = sh.drive_command(results, p, "py")           # tuned: the horizons, with the same grid
    assert cmd[2:4] == ["--stage", "horizons"] and "0.25" in cmd
    assert cmd[cmd.index("--horizons") + 1] == "3000"
    for seed in range(3):
        r = _rec("adams", 5e-4, seed, 3000, 3.9)
        results[r["id"]] = r
    assert sh.drive_command(results, p, "py") is None


def _with_horizons(gaps: dict[int, list[float]]) -> tuple[dict, sh.Plan]:
    p = sh.Plan(settings=("adams", "scape99", "f_fp8_e4m3_d10"), horizons=tuple(gaps))
    results = {}
    _tuned(results, p, {"adams": 1e-3, "scape99": 4e-3, "f_fp8_e4m3_d10": 2e-3})
    for steps, diffs in gaps.items():
        for seed, d in enumerate(diffs):
            base = 4.0 - 0.01 * seed
            for name, lr, loss in (("adams", 1e-3, base), ("scape99", 4e-3, base + d)):
                if steps == p.tune_steps and seed == 0:
                    r = results[_rec(name, lr, 0, steps, 0).__getitem__("id")]
                    r["final_val_loss"] = loss
                    continue
                r = _rec(name, lr, seed, steps, loss)
                results[r["id"]] = r
    return results, p


def test_summary_gaps_tokens_per_param_and_a_power_law_fit(tmp_path):
    # the gap falls as 2 x^(-1/2) with x = steps/1000 tokens per parameter, seeds spread +-0.01
    law = {h: 2 * (h / 1000) ** -0.5 for h in (3000, 10000, 30000)}
    results, p = _with_horizons({h: [g - 0.01, g, g + 0.01] for h, g in law.items()})
    s = sh.horizon_summary(results, PARAMS, TOKENS, p)
    assert s["tune"]["scape99"]["best"] == 4e-3 and not s["tune"]["scape99"]["at_edge"]
    g = s["gaps"]["scape99"]
    assert sorted(g) == ["10000", "3000", "30000"]
    assert g["3000"]["n"] == 3 and g["3000"]["tokens_per_param"] == 3.0
    assert abs(g["30000"]["mean"] - law[30000]) < 1e-12 and g["30000"]["commit"] == COMMIT
    f = s["fit"]
    assert f["ok"] and abs(f["b"] - 0.5) < 1e-9 and abs(f["a"] - 2.0) < 1e-9
    assert f["b_lo"] < 0.5 < f["b_hi"]
    # 2 x^(-1/2) = 0.04 at x = 2500 tokens per parameter = 2.5M steps of 1000 tokens
    assert abs(f["x_margin"] - 2500) < 1e-6 and abs(f["steps_margin"] - 2.5e6) < 1e-3
    lo, hi = f["steps_margin_range"]
    assert lo < 2.5e6 < hi
    # an exact law: every fitted gap is the measured one, nothing left over
    assert f["dof"] == 1 and f["chi2"] < 1e-18
    assert all(abs(pt["fit"] - pt["mean"]) < 1e-12 for pt in f["fitted"])
    text = sh.render_horizons(s, "figures")
    assert text.startswith(sh.H_BEGIN) and text.rstrip().endswith(sh.H_END)
    assert "| SCAPE-99 (fp32, geometric 10%) (`scape99`) | 30,000 | 30.0 | 3 |" in text
    assert "b = 0.500 [" in text and "2500 tokens per parameter, 2,500,000 steps" in text
    assert f"{law[30000]:+.3f} against {law[30000]:+.3f} at 30.0" in text
    assert "sum to 0.00 on 1 degree(s) of freedom" in text
    # each seed's own gap, so a horizon with seed 0 alone reads beside the paired ones
    d = law[30000]
    assert f"| 0: {d - 0.01:+.4f}, 1: {d:+.4f}, 2: {d + 0.01:+.4f} |" in text
    # JSON in, markdown and figure out
    payload = sh.write_json(results, p, tmp_path / "figures" / "h.json", PARAMS)
    report = tmp_path / "quality.md"
    report.write_text("# Quality\n\nkept\n")
    sh.write_report(json.loads((tmp_path / "figures" / "h.json").read_text()),
                    tmp_path / "figures" / "h.json", report)
    assert report.read_text().startswith("# Quality\n\nkept\n")
    assert payload["summary"]["tokens_per_step"] == 4 * 4 * 64        # the study's
    assert abs(payload["summary"]["fit"]["b"] - 0.5) < 1e-9
    assert (tmp_path / "figures" / "scape99_horizons.png").stat().st_size > 0


def test_both_bytes_views_at_the_tuning_horizon_put_local_step_methods_beside_scape(tmp_path):
    p = sh.Plan(settings=("adams", "scape99", "diloco_h30", "gasloc_h10"), horizons=(10000,))
    results = {}
    # seed 0 at each setting's centre lr: (loss, bytes over the run, bytes per step sampled
    # at steps 2000 and 9000, after SCAPE-99's warm-up over the first 10% of its steps)
    runs = {"adams": (3.45, 55e9, [(2000, 11e9), (9000, 49.5e9)]),
            "scape99": (3.51, 1.8e9, [(2000, 1.2e9), (9000, 1.2e9 + 7000 * 67e3)]),
            "diloco_h30": (3.40, 1.8e9, [(2000, 0.36e9), (9000, 0.36e9 + 7000 * 180e3)]),
            "gasloc_h10": (3.42, 5.5e9, [(2000, 1.1e9), (9000, 1.1e9 + 7000 * 550e3)])}
    for name, (loss, sent, series) in runs.items():
        r = _rec(name, sh.s99.CANDIDATES[name].lr, 0, p.tune_steps, loss, int(sent))
        results[r["id"]] = {**r, "total_sent_series": [list(pt) for pt in series],
                            # local-step runs at another commit: on the bytes views, not paired
                            "commit": "fedcba9" if name in ("diloco_h30", "gasloc_h10") else COMMIT}
    for name in p.settings:                  # the other lrs of each grid lose
        for lr in sh.lr_grid(name, p.lr_factors):
            r = _rec(name, lr, 0, p.tune_steps, 9.0)
            results.setdefault(r["id"], r)
    s = sh.horizon_summary(results, PARAMS, TOKENS, p)
    front = {pt["candidate"]: pt for pt in s["frontier"]}
    assert {n: pt["family"] for n, pt in front.items()} == {
        "adams": "dense AdamS", "scape99": "SCAPE", "diloco_h30": "DiLoCo", "gasloc_h10": "GASLoC"}
    assert math.isclose(front["diloco_h30"]["steady_step_bytes"], 180e3)
    assert math.isclose(front["scape99"]["steady_step_bytes"], 67e3)
    # DiLoCo ends lowest at SCAPE-99's total bytes; per step SCAPE-99 sends least, so at its
    # bytes per step it is the best there is
    assert front["scape99"]["best_within"] == "diloco_h30"
    assert front["scape99"]["best_within_per_step"] == "scape99"
    assert front["gasloc_h10"]["best_within_per_step"] == "diloco_h30"
    text = sh.render_horizons(s, "figures")
    assert ("| DiLoCo, H = 30 (`diloco_h30`) | 0.002 | 3.4000 | 1,800.0 | 180.0 | **this** | "
            "**this** | fedcba9 |") in text
    assert "(figures/scape99_horizons_bytes.png)" in text
    assert sorted(s["gaps"]) == ["scape99"]
    # a grid that waits for a run (DiLoCo's winner at its lowest lr: one more below) keeps its
    # best finished lr on the bytes views, marked as such; the tuning table says what it waits for
    low = sh.lr_grid("diloco_h30", p.lr_factors)[0]
    r = _rec("diloco_h30", low, 0, p.tune_steps, 3.30, int(1.8e9))
    waiting = {**results, r["id"]: {**r, "commit": "fedcba9"}}
    w = sh.horizon_summary(waiting, PARAMS, TOKENS, p)
    assert w["tune"]["diloco_h30"]["best"] is None and w["tune"]["diloco_h30"]["so_far"] == low
    pt = next(pt for pt in w["frontier"] if pt["candidate"] == "diloco_h30")
    assert pt["so_far"] and pt["lr"] == low and pt["seed0"] == 3.30
    text = sh.render_horizons(w, "figures")
    assert f"| {low:g} (best so far: its grid waits) | 3.3000 |" in text
    assert f"waits for {low / 2:g}" in text
    # the report merges another checkout's runs (its own record of a run wins) and draws both
    # views
    local = {k: v for k, v in results.items() if v["commit"] == "fedcba9"}
    json_path, other = tmp_path / "figures" / "h.json", tmp_path / "local.json"
    sh.write_json({k: v for k, v in results.items() if k not in local}, p, json_path, PARAMS)
    sh.write_json({**local, **{k: {**v, "final_val_loss": 0.0} for k, v in results.items()
                               if k not in local}}, p, other, PARAMS)
    assert sh.main(["--report-only", "--json", str(json_path), "--runs-from", str(other),
                    "--report", str(tmp_path / "quality.md"), "--horizons", "10000",
                    "--settings", *p.settings]) == 0
    merged = sh.sq.json_runs(json_path)
    assert merged == results
    assert (tmp_path / "figures" / "scape99_horizons_bytes.png").stat().st_size > 0


def test_held_out_gap_reads_the_last_fifth_of_the_training_logs():
    run = {"steps": 1000, "final_val_loss": 3.0,
           "train_loss": [[s, 9.0 if s <= 800 else (2.8 if s % 200 else 2.6)]
                          for s in range(100, 1001, 100)]}
    g = sh.held_out_gap(run)            # the logs at 900 and 1000: 2.8 and 2.6
    assert g["logs"] == 2 and abs(g["gap"] - 0.3) < 1e-12
    assert abs(g["se"] - math.sqrt(0.02) / math.sqrt(2)) < 1e-12
    assert sh.held_out_gap({**run, "train_loss": [[1000, 2.0]]}) is None   # no spread to read
    # the summary reads every seed's runs at the tuned lr, and the page shows them per horizon
    results, p = _with_horizons({3000: [0.2, 0.2, 0.2], 10000: [0.1, 0.2, 0.3]})
    for r in results.values():
        r["train_loss"] = [[r["steps"], r["final_val_loss"] - 0.05],
                           [r["steps"] - 1, r["final_val_loss"] - 0.15]]
    s = sh.horizon_summary(results, PARAMS, TOKENS, p)
    assert sorted(s["held_out"]) == ["10000", "3000"]
    assert sorted(s["held_out"]["10000"]) == ["0", "1", "2"]
    assert abs(s["held_out"]["3000"]["0"]["scape99"]["gap"] - 0.1) < 1e-12
    # validation - training for each, then SCAPE-99's gap on training and on validation loss,
    # each seed's and their mean
    text = sh.render_horizons(s, "figures")
    assert "| 10,000 | 0 | +0.100 ± 0.050 | +0.100 ± 0.050 | +0.100 ± 0.071 | +0.100 |" in text
    assert "| 10,000 | 2 | +0.100 ± 0.050 | +0.100 ± 0.050 | +0.300 ± 0.071 | +0.300 |" in text
    assert "| 10,000 | mean of 3 |  |  | +0.200 | +0.200 |" in text


def test_no_trend_is_read_from_two_horizons_or_a_closed_gap():
    results, p = _with_horizons({3000: [0.3, 0.31, 0.29], 10000: [0.2, 0.21, 0.19]})
    f = sh.horizon_summary(results, PARAMS, TOKENS, p)["fit"]
    assert not f["ok"] and "2 horizon(s)" in f["why"]
    results, p = _with_horizons({3000: [0.3, 0.31, 0.29], 10000: [0.1, 0.11, 0.09],
                                 30000: [-0.01, 0.0, -0.02]})
    s = sh.horizon_summary(results, PARAMS, TOKENS, p)
    assert not s["fit"]["ok"] and "not positive at 30 tokens/param" in s["fit"]["why"]
    assert "No power law is fitted to SCAPE-99's gap: the gap is not positive" in \
        sh.render_horizons(s, "figures")


def test_a_summary_before_any_run_or_without_the_baseline_says_so():
    s = sh.horizon_summary({}, PARAMS, TOKENS, sh.Plan(settings=("scape99",)))
    assert s["gaps"] == {} and not s["fit"]["ok"] and s["frontier"] == []
    assert "not run" in sh.render_horizons(s, "figures")


def test_pairing_across_commits_is_refused_in_the_horizon_summary():
    results, p = _with_horizons({3000: [0.3, 0.31, 0.29]})
    rid = sh.HRun("adams", 1e-3, 1, 3000, "horizons").id("study")
    results[rid] = {**results[rid], "commit": "fedcba9"}
    with pytest.raises(sq.MixedCommitsError, match=f"fedcba9: {rid}"):
        sh.horizon_summary(results, PARAMS, TOKENS, p)


# ------------------------------------------------------------------ a killed study resumes


def _study(out: Path, tok: Path) -> list[str]:
    return [sys.executable, str(REPO / "scripts" / "study_horizons.py"), "--shape", "tiny",
            "--ranks", "2", "--horizons", "8", "--tune-steps", "8", "--lr-factors", "1",
            "--settings", "scape99", "--seeds", "1", "--checkpoint-every", "2",
            "--out-dir", str(out), "--json", str(out / "h.json"),
            "--extra", f"data.tokenizer.cache_dir={tok}"]


@pytest.mark.dist
@pytest.mark.slow
def test_a_killed_study_run_resumes_to_the_uninterrupted_final_loss(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tok = tmp_path / "tok"
    whole = subprocess.run(_study(tmp_path / "whole", tok), env=env, capture_output=True,
                           text=True, timeout=600)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    rid = sh.HRun("scape99", 4e-3, 0, 8, "tune").id("tiny")
    want = json.loads((tmp_path / "whole" / "runs" / rid / "result.json").read_text())
    # killed (the whole process group, SIGKILL) once the step-2 checkpoint is complete: every
    # save is slowed so that the kill lands before the run ends
    run_dir = tmp_path / "cut" / "runs" / rid
    first = run_dir / "train" / "checkpoints" / "step_00000002" / "manifest.json"
    proc = subprocess.Popen(_study(tmp_path / "cut", tok), start_new_session=True,
                            env={**env, "SCAPE_FAULT_SAVE_DELAY_S": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # torchrun starts its workers in sessions of their own: they outlive the study's group
    subprocess.run(["pkill", "-9", "-f", f"run_dir={run_dir}/train"], check=False)
    time.sleep(1)
    assert first.exists() and not (run_dir / "result.json").exists()
    again = subprocess.run(_study(tmp_path / "cut", tok), env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    got = json.loads((run_dir / "result.json").read_text())
    assert "resum" in (run_dir / "train.log").read_text().lower()
    assert got["final_val_loss"] == want["final_val_loss"]        # bit-equal
    assert got["val_loss"] == want["val_loss"] and got["sent_bytes"] == want["sent_bytes"]
    assert got["commit"] == sq.code_state()["commit"] and "resume=auto" in got["command"]
    # a finished run is skipped
    third = subprocess.run(_study(tmp_path / "cut", tok), env=env, capture_output=True,
                           text=True, timeout=600)
    assert third.returncode == 0 and "ran 0 runs" in third.stdout


def test_the_fit_says_how_far_the_gaps_are_from_a_power_law():
    # the middle horizon sits 3 of its standard errors (in log gap) above a straight line
    pts = [{"x": 3.0, "mean": 0.3, "se": 0.03}, {"x": 10.0, "mean": 0.3, "se": 0.03},
           {"x": 30.0, "mean": 0.03, "se": 0.003}]
    f = sh.power_law(pts)
    assert f["ok"] and f["dof"] == 1
    assert f["chi2"] > 10                       # far above its 1 degree of freedom
    w = [(pt["mean"] / pt["se"]) ** 2 for pt in pts]
    assert math.isclose(f["chi2"], sum(wi * math.log(pt["mean"] / q["fit"]) ** 2
                                       for wi, pt, q in zip(w, pts, f["fitted"])))
