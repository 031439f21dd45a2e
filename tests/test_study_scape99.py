"""``scripts/study_scape99.py``'s report: the search table and the quality-per-byte frontier, from
result records (no training: the records are made up, their arithmetic is checked)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import study_scape99 as s99  # noqa: E402


COMMIT = "0123abc"


def _run(name: str, seed: int, loss: float, sent: int, commit: str | None = COMMIT) -> dict:
    c = s99.CANDIDATES[s99.FRONTIER_ALIASES.get(name, name)]
    return {"id": s99.run_id(c, seed, s99.STEPS), "candidate": c.name, "label": c.label,
            "lr": c.lr, "seed": seed, "steps": s99.STEPS, "settings": c.overrides(s99.STEPS),
            "final_val_loss": loss, "diverged": False, "sent_bytes": sent,
            **({} if commit is None else {"commit": commit, "dirty": False})}


RESULTS = {r["id"]: r for r in [
    _run("adams", 0, 3.84, 16_000), _run("adams", 1, 3.86, 16_000), _run("adams", 2, 3.85, 16_000),
    _run("scape99", 0, 4.14, 550),
    _run("f_fp8_e4m3_d01", 0, 4.05, 70), _run("f_fp32_d01", 0, 4.04, 200),
    # the d 0.1 fp8 point is the search's s99_fp8_d10_now under another name
    _run("s99_fp8_d10_now", 0, 3.83, 570), _run("s99_fp8_d10_now", 1, 3.84, 570),
    _run("s99_fp8_d10_now", 2, 3.81, 570),
    _run("adamw", 0, 3.80, 16_500),
]}


def test_the_frontier_names_the_best_setting_at_each_budget():
    points = {p["candidate"]: p for p in s99.frontier(RESULTS)["points"]}
    assert set(points) == {"adams", "adamw", "scape99", "f_fp8_e4m3_d01", "f_fp32_d01",
                           "f_fp8_e4m3_d10"}
    assert points["f_fp8_e4m3_d10"]["source"] == "s99_fp8_d10_now"
    best = {n: p["best_within"] for n, p in points.items()}
    assert best == {"f_fp8_e4m3_d01": "f_fp8_e4m3_d01", "f_fp32_d01": "f_fp32_d01",
                    "scape99": "f_fp32_d01", "f_fp8_e4m3_d10": "f_fp8_e4m3_d10",
                    "adams": "f_fp8_e4m3_d10", "adamw": "adamw"}
    p = points["f_fp8_e4m3_d10"]["paired"]
    assert p["n"] == 3 and abs(p["mean"] - (-0.01 - 0.02 - 0.04) / 3) < 1e-12
    assert abs(points["scape99"]["gap_seed0"] - 0.30) < 1e-12


def test_the_report_keeps_the_search_and_the_frontier_apart(tmp_path):
    report = tmp_path / "quality.md"
    report.write_text("# Quality\n\nkept\n")
    s99.write_outputs(RESULTS, tmp_path / "figures" / "scape99_search.json", report)
    text = report.read_text()
    assert text.startswith("# Quality\n\nkept\n") and text.count(s99.F_BEGIN) == 1
    search = text[text.index(s99.BEGIN):text.index(s99.END)]
    assert "`adamw`" not in search and "`s99_fp8_d10_now`" in search   # frontier-only left out
    front = text[text.index(s99.F_BEGIN):text.index(s99.F_END)]
    assert "`adamw`" in front and "-0.0233 [" in front
    assert (tmp_path / "figures" / "frontier.png").stat().st_size > 0
    s99.write_outputs(RESULTS, tmp_path / "figures" / "scape99_search.json", report)
    assert report.read_text() == text                     # regenerated in place


def test_a_scale_check_is_reported_apart_from_the_search(tmp_path):
    def scaled(name, loss):
        c = s99.CANDIDATES[name]
        r = _run(name, 0, loss, 100)
        return {**r, "id": s99.run_id(c, 0, s99.STEPS, "study_x5"), "shape": "study_x5",
                "wall_s": 1.0, "val_loss": [[300, 5.0], [3000, loss]]}

    big = [scaled("adams", 3.50), scaled("scape99", 3.90)]
    results = {**RESULTS, **{r["id"]: r for r in big}}
    assert len({r["id"] for r in big} | set(RESULTS)) == len(RESULTS) + 2   # ids kept apart
    report = tmp_path / "quality.md"
    report.write_text("# Quality\n")
    s99.write_outputs(results, tmp_path / "figures" / "scape99_search.json", report)
    text = report.read_text()
    scale = text[text.index(s99.S_BEGIN):text.index(s99.S_END)]
    assert "| `study_x5` | SCAPE-99 (fp32, geometric 10%) (`scape99`) | 0.004 | 3000 | 3.9000 | " \
           "+0.4000 |" in scale
    search = text[text.index(s99.BEGIN):text.index(s99.END)]
    assert "3.9000" not in search and "3.5000" not in search    # the search's gaps are unmoved
    assert (tmp_path / "figures" / "scape99_scale.png").stat().st_size > 0


def test_every_setting_the_search_ran_is_on_the_frontier_with_its_bytes_per_step():
    geo3 = _run("s99_fp8_d08_geo3", 0, 3.82, 505)
    results = {**RESULTS, geo3["id"]: geo3}
    points = {p["candidate"]: p for p in s99.frontier(results)["points"]}
    assert points["s99_fp8_d08_geo3"]["family"] == s99.OTHER_SETTINGS
    assert points["scape99"]["best_within"] == "s99_fp8_d08_geo3"      # 505 <= 550 bytes
    # steady bytes per step: a constant-bytes run's total over its steps; SCAPE-99's (geometric
    # warm-up) from the no-warm-up run of its density and payload; none for d 0.08 fp8
    steps = s99.STEPS
    assert points["f_fp8_e4m3_d01"]["steady_step_bytes"] == 70 / steps
    assert points["scape99"]["steady_step_bytes"] == 200 / steps
    assert "f_fp32_d01" in points["scape99"]["steady_source"]
    assert points["s99_fp8_d08_geo3"]["steady_step_bytes"] is None
    # per step, SCAPE-99 (4.14) is beaten by the no-warm-up run of its own steady bytes (4.04)
    assert points["scape99"]["best_within_per_step"] == "f_fp32_d01"
    assert points["adams"]["steady_step_bytes"] == 16_000 / steps
    # a run's own series over its steady steps wins over any estimate
    # (its warm-up is 3% of 3000 steps: steps 1-90)
    series = {**geo3, "total_sent_series": [[60, 600.0], [120, 1000.0], [3000, 9000.0]]}
    assert s99.steady_step_bytes(series, results) == (8000 / 2880, "the run's steady steps")


def test_the_report_refuses_to_pair_runs_of_different_commits_and_says_so(tmp_path):
    other = _run("s99_fp8_d10_now", 1, 3.84, 570, commit="fedcba9")
    results = {**RESULTS, other["id"]: other}
    points = {p["candidate"]: p for p in s99.frontier(results)["points"]}
    refused = points["f_fp8_e4m3_d10"]["paired"]["refused"]
    assert "different commits" in refused and "fedcba9: s99_fp8_d10_now_lr0.002_s1_h3000" in refused
    assert abs(points["f_fp8_e4m3_d10"]["gap_seed0"] + 0.01) < 1e-12   # seed 0: one commit
    # seed 0 of another commit: no gap at all, in the table either
    moved = {**RESULTS["scape99_lr0.004_s0_h3000"], "commit": "fedcba9"}
    results[moved["id"]] = moved
    report = tmp_path / "quality.md"
    report.write_text("# Quality\n")
    s99.write_outputs(results, tmp_path / "figures" / "scape99_search.json", report)
    text = report.read_text()
    front = text[text.index(s99.F_BEGIN):text.index(s99.F_END)]
    row = next(line for line in front.splitlines() if "(`scape99`)" in line)
    assert s99.REFUSED in row and "+0.3000" not in row
    row = next(line for line in front.splitlines() if "(`f_fp8_e4m3_d10`)" in line)
    assert s99.REFUSED in row and "-0.0100" in row
    # a run that records the evidence of identical training at the other commit pairs again
    proof = {"commit": "fedcba9", "evidence": "40-step runs identical bit for bit"}
    for r in s99.runs_of(results, "adams"):
        results[r["id"]] = {**r, "same_training_as": [proof]}
    points = {p["candidate"]: p for p in s99.frontier(results)["points"]}
    assert abs(points["scape99"]["gap_seed0"] - 0.30) < 1e-12
    assert points["scape99"]["paired"]["commit"] == "fedcba9"


FAKE_TRAINER = '''
import json, pathlib, signal, sys, time
train, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
train.mkdir(parents=True, exist_ok=True)
if not (train / "saved").exists():        # the first segment trains until SIGTERM, then "saves"
    def save(*_):
        (train / "saved").write_text("checkpoint")
        sys.exit(143)
    signal.signal(signal.SIGTERM, save)
    (train / "ready").write_text("")
    time.sleep(60)
    sys.exit(1)
time.sleep(0.5)                           # the resumed segment finishes
(train / "metrics.jsonl").write_text(json.dumps({"step": steps, "val_loss": 3.5}) + "\\n")
'''

STUDY = '''
import sys
sys.path.insert(0, {scripts!r})
import study_quality as sq, study_scape99 as s99
s99.command = lambda c, seed, steps, ranks, train, *rest: [sys.executable, {fake!r}, str(train), str(steps)]
sq.cli(lambda: (s99.execute(s99.CANDIDATES["adams"], 0, 40, 1, __import__("pathlib").Path({runs!r}),
                            [], s99.SHAPE, checkpoint_every=10), 0)[1])
'''


def test_a_stopped_run_passes_sigterm_on_and_its_time_counts_when_it_resumes(tmp_path):
    """SIGTERM to the study reaches the trainer (which checkpoints), the study exits 143 and
    says so, and the run's recorded wall time includes the stopped segment."""
    import json
    import signal
    import subprocess
    import time

    fake, study = tmp_path / "fake_trainer.py", tmp_path / "study.py"
    fake.write_text(FAKE_TRAINER)
    runs = tmp_path / "runs"
    study.write_text(STUDY.format(scripts=str(REPO / "scripts"), fake=str(fake), runs=str(runs)))
    run_dir = runs / s99.run_id(s99.CANDIDATES["adams"], 0, 40)

    proc = subprocess.Popen([sys.executable, str(study)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "train" / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143, err
    assert "stopped:" in err and "start the study again" in err
    assert (run_dir / "train" / "saved").exists()           # the trainer got SIGTERM, not a kill
    before = json.loads((run_dir / "code.json").read_text())["wall_s_before"]
    assert before >= 1.0

    done = subprocess.run([sys.executable, str(study)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["final_val_loss"] == 3.5
    assert result["wall_s"] >= before + 0.5
