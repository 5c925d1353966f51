"""The samples' kind, in one process: padding and the attention_mask follow what the data is (dict samples of ids
whose lengths differ, learnt from its first samples or declared by data.pad), never one micro-batch's luck; a sample
of another kind is one line naming its sizes; a stream that raises mid-pass (a Hugging Face column that changes
type) is one line, exit 2, the checkpoints before it kept; a Python list of samples is a map-style dataset; a
`labels` key that forward does not take becomes the targets, and the log says so once."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from distrib import cli, fit
from distrib.config import load_config
from distrib.data.batching import Failed
from distrib.data.collate import Collate
from distrib.data.stream_read import Layout, StreamCollate, WorkerStream, kinds_of
from distrib.errors import ConfigError, UserError
from tests.helpers.stream_kinds import CausalBag, RaggedIds, loss_of_each_alone, ragged_test, write_bad_jsonl
from tests.helpers.support import load_weights, sets

FIT = {"train.global_batch_size": 8, "train.optimizer": "sgd", "train.lr": 0.1, "train.warmup_steps": 2,
       "train.schedule": "constant", "train.epochs": 0, "train.max_steps": 6, "run.progress": False,
       "dist.device": "cpu", "checkpoint.every_steps": 0, "data.eval_batch_size": 6}
STREAMS = ("model.factory=tests.helpers.streams:id_model", "train.max_steps=100", "train.epochs=1",
           "train.global_batch_size=16", "train.schedule=constant", "train.warmup_steps=2", "run.progress=false",
           "dist.device=cpu", "checkpoint.every_steps=5", "checkpoint.keep_last=2")


def _ids(*lengths: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.arange(1, n + 1), "labels": torch.arange(1, n + 1)} for n in lengths]


def test_padding_and_the_mask_follow_the_datas_kind_not_the_micro_batch():
    rows = _ids(16, 16, 16, 16, 16, 16, 16, 16, 11, 11, 11, 11)
    padded = Collate(pad_id=0).learnt(rows)
    assert padded.padded and not Collate().learnt(rows[:8]).padded
    kinds = set()
    for part in (rows[:4], rows[4:8], rows[6:10], rows[8:]):  # equal lengths, or not: one structure
        inputs, _ = padded.expecting(rows)(part)
        assert inputs.keys() == {"input_ids", "labels", "attention_mask"}
        kinds.add(kinds_of((inputs, None)))
    assert kinds == {"{input_ids: int64 1-d, labels: int64 1-d, attention_mask: int64 1-d} -> none"}
    # Declared: samples all of one length are padded (a mask) when data.pad = always.
    assert Collate().learnt(rows[:8], "always")(rows[:2])[0]["attention_mask"].tolist() == [[1] * 16] * 2
    with pytest.raises(UserError, match=r"^data.pad = 'always': the samples are float32 \[4\] -> int64 \[\], not"):
        Collate().learnt([(torch.zeros(4), 1)], "always")
    with pytest.raises(ConfigError, match="data.pad = 'sometimes': must be one of auto, always"):
        load_config(None, ["data.pad=sometimes"])
    # Learnt unpadded (every sample 16 ids): a shorter one later is one line naming its sizes and data.pad.
    unpadded = Collate().learnt(rows[:8]).expecting(rows)
    wrong = unpadded(rows[6:10])
    assert isinstance(wrong, Failed) and wrong.message.startswith(
        "data: a sample of {input_ids: int64 [11], labels: int64 [11]}, where the data's samples are {input_ids: "
        "int64 [16], labels: int64 [16]}; fix: --set data.pad=always"), wrong.message
    # Float features are never padded: a vector of 5 where the data's are 4 is another kind of sample.
    x4 = [{"x": torch.zeros(4), "labels": torch.tensor(1)}] * 2
    features = Collate().learnt(x4 + [{"x": torch.zeros(5), "labels": torch.tensor(1)}]).expecting(x4)
    assert not features.padded
    assert features([{"x": torch.zeros(5), "labels": torch.tensor(0)}]).message.startswith(
        "data: a sample of {x: float32 [5], labels: int64 []}, where the data's samples are {x: float32 [4], labels: "
        "int64 []}; fix: make every sample alike")


def test_a_stream_that_raises_mid_pass_ends_its_workers_items_with_one_failed_line():
    class Raising(RaggedIds):
        def __iter__(self):
            for index, row in enumerate(super().__iter__()):
                if index == 20:
                    raise ValueError("Couldn't cast\nlabels: string\nto\nint64")
                yield row

    layout = Layout(False, 0, 1, global_batch_size=8, grad_accum_steps=1, num_workers=1)
    items = list(WorkerStream(Raising(100), layout, StreamCollate(Collate(padded=True)), None).read(0))
    assert [isinstance(item.batch, Failed) for item in items] == [False, False, True]
    assert items[-1].batch.message.startswith("data: reading the stream raised ValueError: Couldn't cast labels: "
                                              "string to int64; fix:")


@pytest.mark.timeout(300)
def test_lists_of_samples_and_labels_that_forward_does_not_take(tmp_path, capfd):
    """A list of ragged dict samples trains (map-style, padded), its labels the targets of a model whose forward takes
    none (the log says so, once); a list of (x, class) pairs trains bitwise as the same tensors."""
    train, test = [*ragged_test(40)], ragged_test(18)
    summary = fit(CausalBag, train, test, overrides={**FIT, "run.dir": str(tmp_path / "ids")})
    err = capfd.readouterr().err
    assert err.count("the samples' 'labels' are the targets: CausalBag.forward(input_ids, attention_mask) takes "
                     "none, so they go to the loss, not to forward") == 1, err
    assert summary["steps"] == 6 and summary["test_count"] == 18
    model = CausalBag()
    model.load_state_dict(load_weights(tmp_path / "ids"))
    assert summary["test_loss"] == pytest.approx(loss_of_each_alone(model.eval(), test), rel=1e-5)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    common = {**FIT, "data.num_classes": 3, "data.loader": "dataloader"}
    summaries = [fit(lambda: torch.nn.Linear(6, 3), data, (x[:16], y[:16]),
                     overrides={**common, "run.dir": str(tmp_path / name)})
                 for name, data in (("pairs", (x, y)), ("list", [(x[i], int(y[i])) for i in range(64)]))]
    weights = load_weights(tmp_path / "pairs"), load_weights(tmp_path / "list")
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    assert summaries[0]["test_loss"] == summaries[1]["test_loss"]


def _checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def _one_line(code: int, err: str, *expected: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and err.count("distrib: error") == 1, err
    last = err.strip().splitlines()[-1]
    for text in expected:
        assert text in last, last
    return last


@pytest.mark.timeout(300)
def test_a_feature_vector_that_grows_at_a_batch_boundary_is_one_line(tmp_path, capfd):
    run_dir = tmp_path / "run"
    code = cli.main(["train", *sets(*STREAMS, "data.factory=tests.helpers.stream_kinds:features_grow",
                                    f"data.kwargs={{folder = '{tmp_path / 'shards'}'}}", f"run.dir={run_dir}")])
    _one_line(code, capfd.readouterr().err,
              "train data: a sample of {x: float32 [5], ids: int64 [], labels: int64 []}, where the data's samples are"
              " {x: float32 [4], ids: int64 [], labels: int64 []} (at step 19 of pass 0: the checkpoints before it are "
              "kept); fix: make every sample alike")
    assert _checkpoints(run_dir) == ["step_00000010.pt", "step_00000015.pt"]


@pytest.mark.skipif(not importlib.util.find_spec("datasets"), reason="needs datasets (the dev extra)")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bad, said", [
    ("type", "ArrowInvalid: Failed to parse string: 'class 0' as a scalar of type int64 (at step 19 of pass 0: the "
             "checkpoints before it are kept)"),
    ("key", "CastError: Couldn't cast x: list<item: double> child 0, item: double ids: int64 labels: int64 extra: "
            "int64 to {'x': List(Value('float64')), 'ids': Value('int64'), 'labels': Value('int64')} because column "
            "names don't match (at step 19 of pass 0: the checkpoints before it are kept)"),
])
def test_a_hugging_face_stream_whose_column_changes_type_is_one_line(tmp_path, capfd, bad, said):
    """World 1 here (the world-2 run: tests/integration/test_streams.py): 4 files of 100 rows, the last one's labels
    strings (or an extra key in its rows); one DataLoader worker reads them in order, so steps 1-18 train and step 19
    meets the last file."""
    write_bad_jsonl(tmp_path / "jsonl", [100] * 4, bad)
    run_dir = tmp_path / "run"
    code = cli.main(["train", *sets(*STREAMS, "data.factory=tests.helpers.streams:hugging_face", "data.num_workers=1",
                                    f"data.kwargs={{folder = '{tmp_path / 'jsonl'}'}}", f"run.dir={run_dir}")])
    _one_line(code, capfd.readouterr().err, f"train data: reading the stream raised {said}")
    assert _checkpoints(run_dir) == ["step_00000010.pt", "step_00000015.pt"]
