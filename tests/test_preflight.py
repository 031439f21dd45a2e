"""For the people who use it: an appended key no schema has fails like a typo; every cheap
precondition (hub, W&B, warmup, density warm-up, paths, resume target) is checked before any
expensive work and reported together; ``--help`` describes every option and lists no fake one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from scape_train.config import ConfigError, override_key_problems
from scape_train.preflight import PreconditionError, check_preconditions, preconditions
from tests.helpers import CONFIG_DIR, compose_config

REPO = Path(__file__).resolve().parents[1]


def _cli(args: list[str], cwd: Path, **env_extra) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m scape_train ARGS`` as a user runs it: no W&B key, no netrc, hubs offline."""
    home = cwd.parent / f"{cwd.name}_home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "NETRC")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), **env_extra)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "scape_train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, time.perf_counter() - start


# -- 1. appended keys ----------------------------------------------------------------------------

@pytest.mark.parametrize("override, closest", [
    ("+optimizer.lrr=1e-3", "optimizer.lr"),
    ("++trainer.max_stepz=3", "trainer.max_steps"),
    ("+logging.wandb.projct=x", "logging.wandb.project"),
    ("+data.tokenizer.kindd=gpt2", "data.tokenizer.kind"),
])
def test_appended_unknown_key_fails_naming_the_closest(override, closest):
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError, match="did you mean") as err:
        compose_config([override])
    assert repr(key) in str(err.value) and closest in str(err.value)
    # the command line is refused before Hydra composes, for typos too
    (message,) = override_key_problems([override])
    assert repr(key) in message and f"did you mean {closest}?" in message
    (typo,) = override_key_problems([override.lstrip("+")])
    assert f"did you mean {closest}?" in typo


def test_appended_keys_that_the_schema_allows_still_compose():
    cfg = compose_config(["+eval.local_data.piqa=/tmp/piqa.jsonl"])   # a free-form dict
    assert cfg.eval.local_data["piqa"] == "/tmp/piqa.jsonl"
    assert override_key_problems(["+experiment=tiny_s90", "model=gpt_tiny", "run_name=x",
                                  "hydra.run.dir=.", "--cfg", "job", "~trainer.seed"]) == []
    with pytest.raises(ConfigError, match="'foo'"):
        compose_config(["+foo=1"])


def test_cli_appended_typo_exits_1_at_once(tmp_path):
    proc, took = _cli(["+optimizer.lrr=1e-3", "trainer.max_steps=1"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "unknown key 'optimizer.lrr'" in proc.stderr and "did you mean optimizer.lr?" in proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []
    print(f"+optimizer.lrr=1e-3 refused in {took:.1f}s")
    assert took < 20


# -- 2. preconditions ----------------------------------------------------------------------------

def test_three_problems_are_reported_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = compose_config(["trainer.max_steps=100", "trainer.warmup_steps=500",
                          "logging.wandb.mode=online", f"run_dir={blocker}/run",
                          f"resume={tmp_path}/missing"])
    with pytest.raises(PreconditionError) as err:
        check_preconditions(cfg)
    problems, message = err.value.problems, str(err.value)
    assert len(problems) == 4, problems
    for fragment in ("trainer.warmup_steps=500", "logging.wandb.mode=offline", "wandb login",
                     "run_dir", "resume="):
        assert fragment in message, fragment
    assert message.startswith("4 problems")
    assert list(tmp_path.iterdir()) == [blocker]          # nothing written


def test_config_checks_collect_instead_of_stopping_at_the_first():
    cfg = compose_config(["trainer.micro_batch_size=0", "trainer.global_batch_size=8",
                          "model.n_heads=3", "optimizer.min_lr=1.0"])
    found = preconditions(cfg)
    assert any("micro_batch_size" in p for p in found)
    assert any("n_heads" in p for p in found)
    assert any("min_lr" in p for p in found)


def test_density_warmup_longer_than_the_run_is_refused():
    found = preconditions(compose_config(["optimizer=scape", "trainer.max_steps=50"]))
    assert any("density_warmup_steps=100 is longer than the run" in p for p in found), found
    assert preconditions(compose_config(["optimizer=scape", "trainer.max_steps=100"])) == []
    assert preconditions(compose_config(["optimizer=scape", "trainer.max_steps=50",
                                         "optimizer.density_schedule=constant"])) == []


def test_hub_is_probed_once_with_a_short_bounded_timeout(monkeypatch):
    """No HF_HUB_OFFLINE and a hub that never answers (the connect hangs): the probe gives up
    after PROBE_TIMEOUT_S, and its verdict is reused by the loaders that follow."""
    from scape_train.data import hub

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid.example")
    calls, release = [], threading.Event()

    def hang(address, timeout=None):
        calls.append(address)
        release.wait(30)                                    # a connect that never completes
        raise OSError("released at the end of the test")

    monkeypatch.setattr(hub.socket, "create_connection", hang)
    monkeypatch.setattr(hub, "_verdicts", {})
    cfg = compose_config(["+experiment=llama500m_s99", "logging.wandb.mode=offline"])
    start = time.perf_counter()
    found = preconditions(cfg)
    took = time.perf_counter() - start
    assert took < hub.PROBE_TIMEOUT_S + 1.0, took
    assert len(found) == 2 and all("did not answer within" in p for p in found), found
    assert "data=local data.path=" in found[0] and "data.tokenizer.path=" in found[1]
    with pytest.raises(hub.HubUnavailableError, match="did not answer"):
        hub.require_hub("dataset x", "data=local")
    assert len(calls) == 1                                  # one probe for all of them
    release.set()


def test_nothing_is_probed_when_nothing_needs_the_hub(monkeypatch):
    from scape_train.data import hub

    monkeypatch.setattr(hub, "hub_problem", lambda *a, **k: pytest.fail("probed"))
    assert preconditions(compose_config([])) == []


def test_cli_offline_hub_says_so_within_seconds_writing_nothing(tmp_path):
    proc, took = _cli(["+experiment=llama500m_s99"], tmp_path, HF_HUB_OFFLINE="1")
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "3 problems" in err and "offline mode is on" in err, err
    assert "data=local data.path=" in err and "data.tokenizer.path=" in err
    assert "logging.wandb.mode=offline" in err and "wandb login" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
    print(f"offline hub (+experiment=llama500m_s99) reported in {took:.1f}s")
    assert took < 12       # ~4.5 s on 2 shared cores, most of it importing torch


def test_cli_wandb_online_without_key_fails_at_once_naming_the_fix(tmp_path):
    # local data (the shipped sample): the preset's online W&B is the only problem
    proc, took = _cli(["+experiment=llama500m_s99", "data=classics"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "logging.wandb.mode=online, but W&B has no API key" in err, err
    assert "logging.wandb.mode=offline" in err and "`wandb login`" in err
    assert "problems" not in err                      # just the one
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
    print(f"W&B online without a key reported in {took:.1f}s")
    assert took < 12


def test_wandb_key_is_found_in_the_environment_or_netrc(tmp_path, monkeypatch):
    from scape_train.config import WandbConfig
    from scape_train.tracking import wandb_problem

    online = WandbConfig(mode="online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert "no API key" in wandb_problem(online, probe=False)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    assert wandb_problem(online, probe=False) is None
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_problem(online, probe=False) is None
    assert wandb_problem(WandbConfig(mode="offline")) is None


# -- 4. --help -----------------------------------------------------------------------------------

def test_no_group_lists_a_fake_schema_option_and_typos_still_fail():
    with pytest.raises(HydraException):
        compose_config(["model=schema"])
    with pytest.raises((HydraException, OmegaConfBaseException)):
        compose_config(["model.d_modle=3"])
    with pytest.raises((HydraException, OmegaConfBaseException)):
        compose_config(["trainer.max_steps=ten"])


def test_every_option_has_a_description():
    """Every field of every schema has a comment that --help shows (add one with a new field)."""
    import dataclasses

    from scape_train.cli_help import _hints, dataclass_of, field_comments
    from scape_train.config import Config

    missing, todo = [], [("", Config)]
    while todo:
        prefix, schema = todo.pop()
        comments, hints = field_comments(schema), _hints(schema)
        for f in dataclasses.fields(schema):
            sub = dataclass_of(hints.get(f.name))
            if sub is not None:
                todo.append((f"{prefix}{f.name}.", sub))
            elif not comments.get(f.name):
                missing.append(f"{prefix}{f.name}")
    assert missing == []


def test_cli_help_shows_descriptions_and_real_options_only(tmp_path):
    proc, _ = _cli(["+experiment=tiny_s90", "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    groups = {line.split(":")[0]: line.split(":", 1)[1] for line in out.splitlines()
              if line.split(":")[0] in ("model", "data", "optimizer", "strategy", "trainer",
                                        "logging", "eval", "experiment")}
    assert len(groups) == 8 and not any("schema" in options for options in groups.values())
    lines = {line.split("=", 1)[0].strip(): line for line in out.splitlines() if "=" in line}
    assert "end this invocation after N more steps" in lines["trainer.stop_after"]
    assert "fraction communicated" in lines["optimizer.density"]
    assert lines["optimizer.density_warmup_steps"].split()[0] == "optimizer.density_warmup_steps=50"
    assert "online | offline | disabled" in lines["logging.wandb.mode"]
    assert "optimizer: adams, adamw, powersgd, scape, topk_adamw" in out
    assert list(tmp_path.iterdir()) == []


# -- 3. one record after a resume ------------------------------------------------------------------

def test_metrics_truncation_keeps_one_row_per_step(tmp_path):
    import json

    from scape_train.metrics import read_metrics, truncate_metrics

    path = tmp_path / "metrics.jsonl"
    rows = ([{"step": s, "loss": float(s)} for s in (1, 2, 3, 4, 5)] + [{"step": 5, "val_loss": 9.0}]
            + [{"step": s, "loss": 10.0 + s} for s in (4, 5, 6)])   # an older resume from 3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')  # torn by a crash
    assert truncate_metrics(path, 5) == 5
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]
    inode = path.stat().st_ino
    assert truncate_metrics(path, 5) == 0 and path.stat().st_ino == inode   # untouched
    assert truncate_metrics(path, 0) == 5 and path.read_text() == ""         # a fresh start
    assert truncate_metrics(tmp_path / "none.jsonl", 3) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary left


# -- 5. docs ---------------------------------------------------------------------------------------

def test_every_experiment_the_docs_and_launchers_name_exists():
    import re

    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "scripts").glob("launch_*")), *sorted(CONFIG_DIR.rglob("*.yaml"))]
    named = {m for path in texts for m in re.findall(r"\+experiment=(\w+)", path.read_text())}
    missing = {n for n in named - {"NAME"} if not (CONFIG_DIR / "experiment" / f"{n}.yaml").is_file()}
    assert named and not missing, missing
