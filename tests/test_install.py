"""The Hydra app works from an installed package (configs and the data sample are package data)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_wheel_composes_experiments(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(REPO)], check=True, cwd=tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    *map(str, wheels.glob("*.whl"))], check=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import scape_train; print(scape_train.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(target))
    out = subprocess.run([sys.executable, "-m", "scape_train", "+experiment=llama500m_s99", "--cfg", "job"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "density: 0.01" in out.stdout and "name: llama500m" in out.stdout
    assert (target / "scape_train" / "assets" / "classics" / "train.jsonl.gz").exists()
