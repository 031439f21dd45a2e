"""The prepared GPU check cannot rot: it lists its checks and their time limits anywhere, a check
past its limit is killed without starving the next, and its CPU-capable checks run at toy sizes
here, through the same code the GPU run uses, writing nothing but the two report files."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from .conftest import REPO

GPU_CHECK = str(REPO / "scripts" / "gpu_check.py")


def test_dry_run_lists_every_check_with_its_limit_most_valuable_first():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [re.match(r"(\S+)\s+(\d+) s", line) for line in proc.stdout.splitlines() if line.strip()]
    assert all(rows), proc.stdout
    limits = {m.group(1): int(m.group(2)) for m in rows}
    total = limits.pop("deadline")
    assert list(limits) == ["scape_vs_adams_step", "train_throughput", "trainer_overhead",
                            "memory_plan", "triton_vs_torch", "offload", "env", "overlap_trace"]
    # one H200 lease: the checks stop themselves within 6 minutes, the backstop included
    backstop = int(re.search(r"timeout --kill-after=(\d+) (\d+)",
                             (REPO / "scripts" / "gpu_check.sh").read_text()).group(2))
    assert total < backstop <= 360 - 5
    one_gpu = {k: v for k, v in limits.items() if k != "overlap_trace"}   # skipped on one GPU
    assert sum(one_gpu.values()) <= total
    # the optional checks run only when named: together, a second call of the same lease
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--only",
                           "train_sweep,compile_granularity"], capture_output=True, text=True,
                          timeout=60)
    optional = dict(re.findall(r"^(\S+)\s+(\d+) s", proc.stdout, flags=re.M))
    assert proc.returncode == 0 and set(optional) == {"train_sweep", "compile_granularity",
                                                       "deadline"}, proc.stdout
    assert sum(int(v) for k, v in optional.items() if k != "deadline") <= total


def test_a_check_past_its_limit_is_killed_and_the_next_one_runs(tmp_path):
    proc = subprocess.run([sys.executable, GPU_CHECK, "--smoke", "--out", str(tmp_path),
                           "--only", "env,overlap_trace", "--limits", "env=0.2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"] == {"error": "timed out after 0.2 s (killed)"}
    assert "skipped" in res["overlap_trace"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.md", "gpu_check.json"]


@pytest.mark.slow
def test_smoke_runs_the_cpu_capable_checks(tmp_path):
    """Toy sizes on the CPU (Triton interpreted), with limits a loaded 2-core machine meets."""
    proc = subprocess.run([sys.executable, GPU_CHECK, "--smoke", "--out", str(tmp_path),
                           "--only", "scape_vs_adams_step,train_throughput,trainer_overhead,"
                           "memory_plan,triton_vs_torch,offload,env", "--deadline", "1200",
                           "--limits", "scape_vs_adams_step=240,train_throughput=300,"
                           "trainer_overhead=200,memory_plan=120,triton_vs_torch=120,offload=60,"
                           "env=60"],
                          capture_output=True, text=True, timeout=1260)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["offload"]["w_equal"] and res["offload"]["residual_equal"]
    step = res["scape_vs_adams_step"]
    for name in ("scape99", "adams"):
        assert len(step[name]["warmup_s"]) == 5 and step[name]["median_s"] > 0
        assert step[name]["counted_host_syncs_per_step"] == 0 and step[name]["launches_per_step"] > 0
        kernels = step[name]["kernels"]            # the profiler's top rows (CPU: operators)
        assert 0 < len(kernels["top"]) <= 10 and kernels["top"][0]["ms"] > 0, kernels
        assert step[name]["cuda_sync"] == {"skipped": "needs CUDA"}
    runs = res["train_throughput"]
    assert list(runs) == ["scape99", "adams", "scape99_selective"]
    for run in runs.values():
        assert run["completed"] and run["tokens_per_s"] > 0 and run["mfu"] > 0, run
    overhead = res["trainer_overhead"]
    assert overhead["trainer"]["completed"] and overhead["bare_loop"]["tokens_per_s"] > 0, overhead
    assert overhead["trainer_over_bare"] > 0
    assert all(p["estimate_gib"] > 0 for p in res["memory_plan"].values())
    assert res["memory_plan"]["scape99_selective"]["activation_checkpointing"] == "selective"
    assert res["triton_vs_torch"]["ok"], res["triton_vs_torch"]
    assert (tmp_path / "gpu.md").read_text().startswith("# GPU check")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.md", "gpu_check.json"]


@pytest.mark.slow
def test_the_optional_checks_train_each_variant_and_name_the_best(tmp_path):
    proc = subprocess.run([sys.executable, GPU_CHECK, "--smoke", "--out", str(tmp_path),
                           "--only", "train_sweep,compile_granularity", "--deadline", "700",
                           "--limits", "train_sweep=580,compile_granularity=100"],
                          capture_output=True, text=True, timeout=760)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["compile_granularity"]["per_block_over_whole"] > 0, res["compile_granularity"]
    sweep = res["train_sweep"]
    runs = {k: v for k, v in sweep.items() if k != "best_mfu"}
    assert list(runs) == ["cudnn_attention", "micro8", "chunk32k", "full_logits"]
    assert all(r["completed"] and r["mfu"] > 0 for r in runs.values()), runs
    assert sweep["best_mfu"][1] == max(r["mfu"] for r in runs.values())
    assert "trainer.loss_chunk_tokens=0" in runs["full_logits"]["overrides"]
    # each run says which attention kernel it trained with (the CPU's: its flash kernel)
    assert any("flash_attention (trainer.attention_backend=cudnn)" in line
               for line in runs["cudnn_attention"]["chosen"]), runs["cudnn_attention"]["chosen"]


@pytest.mark.slow
def test_the_elastic_check_trains_two_replica_groups_alike(tmp_path):
    """On the CPU the workers' backend is gloo either way; on a GPU the single one is NCCL."""
    proc = subprocess.run([sys.executable, GPU_CHECK, "--smoke", "--out", str(tmp_path),
                           "--only", "elastic", "--deadline", "300", "--limits", "elastic=280"],
                          capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())["elastic"]
    assert res["ok"] and res["gloo_pair"]["same_parameters"], res
    for run in ("gloo_pair", "nccl_single"):
        assert res[run]["worker_0"] == {"returncode": 0, "committed_rounds": 3, "device": "cpu",
                                        "backend": "gloo"}, res


def test_a_synchronizing_call_is_named_by_its_innermost_project_frame():
    """``first_cuda_sync`` reports where CUDA's error mode raised: file, line, function, code."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_measure import sync_site

    def reads_a_value():
        raise RuntimeError("called a synchronizing CUDA operation")

    try:
        reads_a_value()
    except RuntimeError as exc:
        where = sync_site(exc)
    assert re.fullmatch(r"tests/test_gpu_check\.py:\d+ in reads_a_value: raise RuntimeError\(.*",
                        where), where
