"""Test-wide environment: offline hubs, W&B off, Triton interpreted (before triton is imported),
and NCCL's discipline on every process: a collective issued from the package outside
``comm.py`` raises (``SCAPE_STRICT_COMM=1`` reaches subprocesses and torchrun workers)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SCAPE_STRICT_COMM", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from scape_train.comm import enforce_comm_only_from_env  # noqa: E402

enforce_comm_only_from_env()

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    return Path(os.environ.get("SCAPE_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (or $SCAPE_SHARED_DATA). Missing: skip locally, fail under CI."""
    path = shared_data_dir()
    if not path.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"shared test data not found at {path} (set SCAPE_SHARED_DATA)")
        pytest.skip(f"shared test data not found at {path}; set SCAPE_SHARED_DATA to its location")
    return path
