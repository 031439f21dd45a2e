import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from scape_train.config import Config, ConfigError, TrainerConfig, grad_accum_steps, validate
from scape_train.schedule import lr_at
from tests.helpers import CONFIG_DIR, compose_config


def test_default_composes_to_typed_config():
    cfg = compose_config()
    assert isinstance(cfg, Config)
    assert isinstance(cfg.trainer, TrainerConfig)
    assert cfg.model.arch == "llama"
    assert cfg.data.source == "classics"
    validate(cfg)


def test_unknown_key_fails():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose_config(["trainer.max_stepz=10"])


def test_wrong_type_fails():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose_config(["trainer.max_steps=ten"])


def test_unknown_group_option_fails():
    with pytest.raises(ConfigCompositionException):
        compose_config(["model=does_not_exist"])


def test_every_experiment_composes_and_validates():
    names = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
    for name in names:
        cfg = compose_config([f"+experiment={name}"])
        validate(cfg, world_size=1)


@pytest.mark.parametrize("override, fragment", [
    ("trainer.global_batch_size=12", "multiple of"),
    ("data.seq_len=100000", "max_seq_len"),
    ("trainer.warmup_steps=100000", "warmup_steps"),
    ("trainer.lr_schedule=linear", "lr_schedule"),
    ("optimizer.min_lr=1.0", "min_lr"),
    ("logging.wandb.mode=sometimes", "wandb.mode"),
])
def test_impossible_values_get_clear_errors(override, fragment):
    cfg = compose_config([override])
    with pytest.raises(ConfigError, match=fragment):
        validate(cfg, world_size=1)


def test_batch_divisibility_uses_world_size():
    cfg = compose_config(["trainer.micro_batch_size=4", "trainer.global_batch_size=24"])
    validate(cfg, world_size=3)  # 24 = 4 x 3 x 2
    assert grad_accum_steps(cfg, 3) == 2
    with pytest.raises(ConfigError, match="multiple of"):
        validate(cfg, world_size=4)


def test_lr_schedules():
    kw = dict(peak=1.0, min_lr=0.1, warmup=10, total=110)
    assert lr_at(5, kind="cosine", **kw) == pytest.approx(0.5)
    assert lr_at(10, kind="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(60, kind="cosine", **kw) == pytest.approx(0.55)
    assert lr_at(110, kind="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(50, kind="wsd", decay_steps=20, **kw) == pytest.approx(1.0)
    assert lr_at(100, kind="wsd", decay_steps=20, **kw) == pytest.approx(0.55)
    assert lr_at(110, kind="wsd", decay_steps=20, **kw) == pytest.approx(0.1)
    assert lr_at(80, kind="constant", **kw) == 1.0
    with pytest.raises(ValueError):
        lr_at(80, kind="step", **kw)
