"""Tasks other than image classification, wrong pairings of user code outside the project: each is one line naming
both shapes or the key, exit 2, before anything is written (the training runs: tests/integration/test_tasks.py)."""

import sys

import pytest

from tests.helpers.support import SMALL, sets
from tests.helpers.task_package import write_task_package

BASE = [*SMALL, "train.epochs=0", "train.warmup_steps=2", "train.log_every=4", "train.global_batch_size=16"]


@pytest.fixture(scope="module")
def task_root(tmp_path_factory):
    root = write_task_package(tmp_path_factory.mktemp("outside"))
    sys.path.insert(0, str(root))  # the in-process runs and the independent checks import taskpkg too
    yield root
    sys.path.remove(str(root))


EARLIER = {"config.toml": b"[run]\ndir = 'earlier'\n", "model.pt": b"earlier weights"}


@pytest.mark.parametrize("overrides, expected", [
    (["data.factory=taskpkg.data:float_tokens", "model.factory=taskpkg.models:gpt", "model.kwargs={seq_len = 16}"],
     ["embeds integer ids", "float32 [2, 16]", "int64"]),
    (["data.factory=taskpkg.data:bytes_lm", "model.factory=taskpkg.models:ten_outputs"],
     ["to [2, 10]", "targets are int64 [2, 16]", "[2, 16, C]"]),
    (["data.factory=taskpkg.data:dict_lm_extra_key", "model.factory=taskpkg.models:dict_lm"],
     ["'token_type_ids'", "DictLM.forward(input_ids, attention_mask, labels)"]),
    (["data.factory=taskpkg.data:dict_lm_no_labels", "model.factory=taskpkg.models:dict_lm"],
     ["{input_ids: int64 [16]} have no targets", "returned no loss"]),
    (["data.factory=taskpkg.data:regression", "model.factory=taskpkg.models:tagger", "train.loss=mse"],
     ["to [2, 5]", "targets are float32 [2]", "needs [2]"]),
    (["data.factory=taskpkg.data:regression", "model.factory=taskpkg.models:regressor"],  # the default loss
     ["to [2]", "targets are float32 [2]", "train.loss = cross_entropy needs [2, C]",
      "for a regression set train.loss = mse"]),
])
def test_wrong_pairings_are_one_line_naming_both_shapes_and_write_nothing(task_root, tmp_path, capsys, overrides,
                                                                          expected):
    from distrib import cli

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name, content in EARLIER.items():
        (run_dir / name).write_bytes(content)
    code = cli.main(["train", *sets(*BASE, *overrides, f"run.dir={run_dir}")])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("distrib: error: ") and err.count("distrib: error") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in last, last
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == EARLIER
