"""``scripts/study_scape99.py``'s report: the search table and the quality-per-byte frontier, from
result records (no training: the records are made up, their arithmetic is checked)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import study_scape99 as s99  # noqa: E402


def _run(name: str, seed: int, loss: float, sent: int) -> dict:
    c = s99.CANDIDATES[s99.FRONTIER_ALIASES.get(name, name)]
    return {"id": s99.run_id(c, seed, s99.STEPS), "candidate": c.name, "label": c.label,
            "lr": c.lr, "seed": seed, "steps": s99.STEPS, "settings": c.overrides(s99.STEPS),
            "final_val_loss": loss, "diverged": False, "sent_bytes": sent}


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
