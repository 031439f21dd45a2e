"""The prepared GPU check cannot rot: it lists its checks anywhere, and its CPU-capable checks run
at toy sizes here, through the same code the GPU run uses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO


def test_dry_run_lists_every_check_and_runs_nothing(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert names == ["env", "cuda_tests", "triton_vs_torch", "offload", "scape_vs_adams_step",
                     "train_throughput", "memory_plan", "overlap_trace"]


@pytest.mark.slow
def test_smoke_runs_the_cpu_capable_checks(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--smoke",
                           "--out", str(tmp_path), "--only",
                           "env,offload,scape_vs_adams_step,train_throughput,memory_plan"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["offload"]["w_equal"] and res["offload"]["residual_equal"]
    step = res["scape_vs_adams_step"]
    assert step["scape_d0.01"]["counted_host_syncs_per_step"] == 0
    assert step["adams"]["counted_host_syncs_per_step"] == 0
    for run in res["train_throughput"].values():
        assert run["returncode"] == 0, run
        assert run["tokens_per_s"] > 0
    assert (tmp_path / "gpu.md").read_text().startswith("# GPU check")
