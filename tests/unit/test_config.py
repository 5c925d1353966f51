"""Config: typed defaults, TOML files, dotted overrides, and a resolved config that reads back unchanged."""

import dataclasses
import tomllib
import typing

import pytest

from distrib.config import Config, TrainConfig, _coerce, _toml_value, load_config, to_toml
from distrib.errors import ConfigError


def test_defaults_are_the_main_job():
    config = load_config()
    assert config == Config()
    assert (config.data.name, config.model.name, config.dist.device) == ("fashion-mnist", "network", "auto")


def test_sections_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().train.lr = 1.0


def test_resolved_config_reads_back_unchanged(tmp_path):
    config = load_config(None, ["train.optimizer=adamw", "model.factory=pkg.mod:build", 'run.dir=runs/a "b"'])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(config))
    assert load_config(str(path)) == config


@pytest.mark.parametrize("override, names", [
    ("train.lr=-0.1", ["train.lr", "-0.1"]),
    ("train.lr=nan", ["train.lr", "nan"]),
    ("train.optimizer=rmsprop", ["train.optimizer", "rmsprop", "sgd, adam, adamw"]),
    ("train.epochz=3", ["train.epochz", "epochs"]),
    ("trian.lr=0.1", ["trian", "train"]),
    ("train.epochs=ten", ["train.epochs", "ten", "int"]),
    ("model.name=resnet", ["model.name", "resnet", "network"]),
    ("model.factory=no-colon", ["model.factory", "no-colon", "package.module:function"]),
    ("model.max_shard_size=5XB", ["model.max_shard_size", "5XB", "GiB", "--set model.max_shard_size=2GB"]),
    ("train.precision=fp8", ["train.precision", "fp8"]),
    ("train.momentum=1.5", ["train.momentum", "1.5"]),
    ("checkpoint.keep_last=0", ["checkpoint.keep_last", "0"]),
    ("train.global_batch_size=0", ["train.global_batch_size", "0"]),
    ("dist.device=tpu", ["dist.device", "tpu", "auto, cpu, cuda"]),
    ("lr=0.1", ["lr=0.1", "section.key=value"]),
])
def test_bad_values_name_the_key_and_value(override, names):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_unbounded_run_is_refused():
    with pytest.raises(ConfigError, match="train.epochs = 0.*max_steps"):
        TrainConfig(epochs=0, max_steps=0)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))
    bad.write_text("[train]\nlr = 0.1\n[surprise]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"\[surprise\]: unknown section"):
        load_config(str(bad))


def test_shipped_configs_load():
    from tests.helpers.support import REPO

    for path in sorted((REPO / "configs").glob("*.toml")):
        load_config(str(path))


def test_lists_and_tables_coerce_and_write_back():
    hints = {"shape": tuple[int, ...], "kwargs": dict, "normalize": str | tuple[tuple[float, ...], ...]}
    assert _coerce("data", "shape", [3, 32, 32], hints["shape"], "[3,32,32]") == (3, 32, 32)
    assert _coerce("data", "normalize", [[0.5], [2]], hints["normalize"], "[[0.5],[2]]") == ((0.5,), (2.0,))
    assert _coerce("data", "normalize", "none", hints["normalize"], "none") == "none"
    kwargs = {"depth": 18, "name": 'a "b"', "widths": [1.5, 2], "inner": {"flag": True}}
    assert _coerce("model", "kwargs", kwargs, hints["kwargs"], None) == kwargs
    assert tomllib.loads(f"v = {_toml_value(kwargs)}")["v"] == kwargs
    for key, bad in (("shape", "x"), ("shape", [1, "a"]), ("kwargs", 3), ("normalize", 5)):
        with pytest.raises(ConfigError, match=f"data.{key}|model.{key}"):
            _coerce("data", key, bad, hints[key], None)
    assert typing.get_type_hints(Config)  # the sections still resolve
