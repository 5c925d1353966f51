"""The user's own data, model and loss, from code outside the project (a temp dir on PYTHONPATH): `distrib train` and
`distrib.fit` at world sizes 1 and 2 against each other, and every model/data mismatch as one line with nothing
written to run.dir."""


import pytest

from tests.helpers.support import SMALL, sets
from tests.helpers.user_package import write_user_package


@pytest.fixture(scope="module")
def user_root(tmp_path_factory):
    return write_user_package(tmp_path_factory.mktemp("outside"))


EARLIER = {"config.toml": b"[run]\ndir = 'earlier'\n", "summary.json": b'{"test_accuracy": 0.9}\n',
           "model.pt": b"earlier weights", "metrics.jsonl": b'{"step": 1}\n'}
SMALL_USER_DATA = [*SMALL, "data.factory=userpkg.data:cifar100_like", "data.kwargs={num_train = 64, num_test = 16}",
                   "data.num_classes=100", "train.global_batch_size=8"]


@pytest.mark.parametrize("overrides, expected", [
    (["data.factory=userpkg.data:bad_labels"], ["label is -1", "out of range"]),
    (["model.factory=userpkg.models:ten_classes"], ["[2, 3, 32, 32] to [2, 10]", "100 classes", "[2, 100]"]),
    ([], ["model.name = 'network'", "1x28x28", "3x32x32", "model.factory"]),
    (["model.factory=userpkg.models:raises"], ["model.factory = 'userpkg.models:raises'", "out of coffee"]),
    (["model.factory=userpkg.broken:build"], ["model.factory", "broken at import"]),
    (["model.factory=userpkg.models:no_parameters"], ["no trainable parameters"]),
    (["model.factory=userpkg.models:resnet", "model.kwargs={depth = 3}"], ["model.factory", "depth"]),
    (["model.factory=userpkg.models:with_batchnorm", "dist.sync_batchnorm=true"],
     ["dist.sync_batchnorm = true", "GPUs only"]),
    (["model.factory=userpkg.models:resnet", "train.loss=userpkg.losses:missing"], ["train.loss", "'missing'"]),
])
def test_mismatches_are_one_line_and_leave_run_dir_untouched(user_root, tmp_path, monkeypatch, capsys, overrides,
                                                           expected):
    from distrib import cli

    monkeypatch.syspath_prepend(str(user_root))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name, content in EARLIER.items():
        (run_dir / name).write_bytes(content)
    code = cli.main(["train", *sets(*SMALL_USER_DATA, *overrides, f"run.dir={run_dir}")])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("distrib: error: ") and err.count("distrib: error") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in last, last
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == EARLIER  # byte-identical, nothing added


def test_a_factory_gets_from_the_data_only_the_arguments_it_declares_by_name():
    """As the docs say (model.factory): a `**kwargs` catches none of the data's (Hugging Face's config classes take
    any keyword, so a num_classes would pass silently into the model's config); nor does a positional-only one."""
    from distrib.config import ModelConfig
    from distrib.data import DataInfo
    from distrib.factory import accepted
    from distrib.models.build import data_kwargs, factory_call

    offered = data_kwargs(DataInfo("tokens", (16,), 256, (), (), (), "int64 [16]"))
    assert offered == {"num_classes": 256, "seq_len": 16, "vocab_size": 256}

    def named(vocab_size, *, seq_len=8, **rest): ...

    def catch_all(**kwargs): ...

    def positional_only(vocab_size, /): ...

    assert accepted(named, offered) == {"vocab_size": 256, "seq_len": 16}
    assert accepted(catch_all, offered) == {} and accepted(positional_only, offered) == {}
    config = ModelConfig(factory="tests.helpers.pretrained:llama", kwargs={"num_hidden_layers": 1})
    assert factory_call(config, DataInfo("tokens", (16,), 256, (), (), (), "int64 [16]")) == (
        "tests.helpers.pretrained:llama", {"num_hidden_layers": 1})
