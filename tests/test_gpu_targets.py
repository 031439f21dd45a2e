"""``scripts/gpu_targets.py``: the GPU speed targets read from a gpu_check.json, met, missed or
not measured (with why), rendered as gpu.md's section."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_targets as gt  # noqa: E402


def _run(**over) -> dict:
    res = {
        "env": {"torch": "2.11.0", "triton": "3.6.0", "name": "NVIDIA H200", "nccl": "2.28.9"},
        "scape_vs_adams_step": {"scape99": {"median_s": 0.0052, "cuda_sync": {"syncs": 0}},
                                "adams": {"median_s": 0.0047, "cuda_sync": {"syncs": 0}}},
        "train_throughput": {
            "scape99": {"mfu": 0.561, "tokens_per_s": 139_000, "data_share_of_step": 0.004},
            "adams": {"mfu": 0.57, "tokens_per_s": 141_000, "data_share_of_step": 0.012}},
        "trainer_overhead": {"trainer_over_bare": 0.99},
    }
    res.update(over)
    return res


def _by_label(rows):
    return {r["target"]: r for r in rows}


def test_each_target_is_met_missed_or_not_measured_with_why():
    rows = _by_label(gt.assess(_run()))
    assert len(rows) == len(gt.TARGETS) == 8
    assert rows["`llama500m_s99` as shipped: MFU"]["met"] is True
    assert rows["`llama500m_s99` as shipped: MFU"]["shown"] == "56.1 %"
    assert rows["SCAPE-99 optimizer step, Llama-500M shapes"]["shown"] == "5.2 ms"
    assert rows["dense AdamS optimizer step"]["met"] is False               # 4.7 ms > 4 ms
    assert rows["data wait, share of a step (the worse preset)"]["met"] is False   # AdamS 1.2%
    ratio = rows["SCAPE-99 tokens/s over AdamS's"]
    assert ratio["met"] is True and ratio["shown"] == "0.986x" and ratio["bound"] == "≥ 0.97x"
    assert rows["SCAPE-99 step: host syncs (error mode)"]["shown"] == "0"
    # a check that timed out, one that was skipped, one that never ran
    rows = _by_label(gt.assess(_run(train_throughput={"error": "timed out after 160 s (killed)"},
                                    trainer_overhead={"skipped": "needs CUDA"},
                                    scape_vs_adams_step=None)))
    mfu = rows["`llama500m_adams` as shipped: MFU"]
    assert mfu["met"] is None and "timed out" in mfu["why"] and mfu["shown"] == "-"
    assert rows["the trainer over a bare compiled loop, GPT-2 124M"]["why"] == "needs CUDA"
    assert rows["dense AdamS optimizer step"]["why"] == "the check did not run"


def test_a_figure_missing_from_a_finished_check_is_not_measured():
    run = _run()
    del run["train_throughput"]["adams"]["tokens_per_s"]
    rows = _by_label(gt.assess(run))
    assert rows["SCAPE-99 tokens/s over AdamS's"]["why"] == "not in the check's result"


def test_render_states_the_device_and_counts():
    text = gt.render({**_run(), "_run": {"date": "2026-12-05", "commit": "abc1234"}})
    assert text.startswith("NVIDIA H200, torch 2.11.0, triton 3.6.0, NCCL 2.28.9; 2026-12-05, "
                           "commit `abc1234`")
    assert "| dense AdamS optimizer step | ≤ 4.0 ms | 4.7 ms | no |" in text
    assert text.rstrip().endswith("6 of 8 targets met; 0 not measured.")


def test_recording_a_run_writes_its_json_and_the_pages_section(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "gpu_check.json").write_text(json.dumps(_run()))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "gpu.md").write_text("# GPU\n\nkept\n")
    assert gt.main([str(tmp_path / "run" / "gpu_check.json"), "--date", "2026-12-05",
                    "--commit", "abc1234", "--docs", str(docs)]) == 0
    saved = json.loads((docs / "figures" / "gpu_check.json").read_text())
    assert saved["_run"] == {"date": "2026-12-05", "commit": "abc1234"}
    page = (docs / "gpu.md").read_text()
    assert page.startswith("# GPU\n\nkept\n") and "<!-- gpu_targets:begin -->" in page
    assert gt.render(saved) in page
