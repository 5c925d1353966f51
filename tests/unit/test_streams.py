"""Streams in one process: the plain layout (the same global batches at any world size and worker count, each
sample once, whatever order the DataLoader delivers the workers' items in), exact restarts from a position, a
sharded source's position in state_dict, the one-line refusals (another world size, another kind of source, no
train.max_steps with a cosine schedule), fit on a stream bitwise equal to the same samples in memory, and a stream
trained by train.epochs passes with no train.max_steps (resumed at a pass boundary and mid-pass, bitwise)."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from distrib.config import load_config
from distrib.data.batching import BatchPlan, DeviceBatches, Finish, load_source_state
from distrib.data.stream import StreamBatches, WorkerOrder
from distrib.data.stream_read import Layout, Shards, StreamCollate, WorkerStream, fingerprint
from distrib.data.tensors import Normalizer, Split
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError, UserError
from distrib.training.opening import count_steps

CPU = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def _row(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([float(i)]), "ids": torch.tensor(i), "labels": torch.tensor(i % 3)}


class Rows(IterableDataset):
    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        return (_row(i) for i in range(self.count))


def _plain_ids(count: int, rank: int, world: int, workers: int, start: dict | None = None) -> list[list[int]]:
    """One rank's micro-batches (as id lists) in training order; the workers' items delivered worst-first (the last
    worker's all at once), as a DataLoader might."""
    layout = Layout(False, rank, world, global_batch_size=8, grad_accum_steps=2, num_workers=workers)
    stream = WorkerStream(Rows(count), layout, StreamCollate(), (start or {}).get("reader"))
    delivered = chain.from_iterable(list(stream.read(w)) for w in reversed(range(workers)))
    order = WorkerOrder(delivered, workers, start or {})
    ids = []
    while (item := order.next()) is not None:
        ids.append(item.batch[0]["ids"].tolist())
    return ids


def test_a_plain_stream_gives_the_same_global_batches_at_any_world_size_and_worker_count():
    one = _plain_ids(53, 0, 1, 1)  # 6 global batches of 8 (two micro-batches of 4), 5 samples left
    assert one == [list(range(i, i + 4)) for i in range(0, 48, 4)]
    ranks = [_plain_ids(53, rank, 2, 3) for rank in range(2)]  # micro-batches of 2, three workers per rank
    for step in range(6):
        together = sorted(i for rank in ranks for micro in rank[2 * step:2 * step + 2] for i in micro)
        assert together == list(range(8 * step, 8 * step + 8))
    trained = [i for rank in ranks for micro in rank for i in micro]
    assert sorted(trained) == list(range(48))  # each once; the partial global batch is not trained


class SplitsItself(IterableDataset):
    """torch's documented worker-aware stream: each DataLoader worker yields every num_workers-th sample."""

    def __iter__(self):
        info = get_worker_info()
        ids = range(40) if info is None else range(info.id, 40, info.num_workers)
        return (_row(i) for i in ids)


def test_a_plain_stream_read_by_workers_must_not_split_itself_among_them():
    """Every worker of a plain stream iterates it whole: a stream that splits itself among the workers would lose
    half its samples, silently. It is one line at the step that first takes worker 1's micro-batch; the same samples
    as a plain stream that does not split itself (Rows) train each once."""
    config = load_config(None, ["data.num_workers=2"]).data
    finish, plan = Finish(Normalizer((), (), uint8=False), None), BatchPlan(None, 4, 1, 0, 1, 0)
    whole = _take(StreamBatches(Rows(40), CPU, config, finish, lambda line: None), plan, 0)
    assert sorted(i for ids in whole for i in ids) == list(range(40))
    try:  # not pytest.raises: its traceback would keep the DataLoader's workers alive past the test
        _take(StreamBatches(SplitsItself(), CPU, config, finish, lambda line: None), plan, 0)
        message = ""
    except UserError as error:
        message = str(error)
    assert message.startswith("train data: the plain stream began with another sample in DataLoader worker 1 than in "
                              "worker 0 ") and "fix: give it n_shards" in message and "\n" not in message, message
    # What the workers compare: contents, not an object's address (its repr), nor a tensor's identity.
    assert fingerprint([_row(0)]) == fingerprint([_row(0)]) != fingerprint([_row(1)])
    assert fingerprint([(object(), [1, 2.5], "a")]) == fingerprint([(object(), [1, 2.5], "a")])


def test_a_plain_stream_restarts_at_a_position_exactly():
    whole = _plain_ids(53, 1, 2, 2)
    start = {"reader": {"samples": 3 * 8}, "next": (3 * 2) % 2}  # after step 3: 6 micro-batches taken
    assert _plain_ids(53, 1, 2, 2, start) == whole[6:]


def _source(sharded: bool):
    if not sharded:
        return Rows(40)
    return Shards([f"{first}" for first in (0, 100, 200)], lambda first: (_row(int(first) + i) for i in range(13)))


def _take(batches: StreamBatches, plan: BatchPlan, start_step: int, count: int | None = None) -> list[list[int]]:
    steps = batches.steps(plan, 0, start_step)
    return [[i for inputs, _ in step for i in inputs["ids"].tolist()] for _, step in zip(range(count or 99), steps)]


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_the_checkpointed_position_resumes_the_pass_exactly(sharded):
    config = load_config(None, ["data.num_workers=0"]).data
    finish = Finish(Normalizer((), (), uint8=False), None)
    plan = BatchPlan(None, 4, 1, 0, 1, 0)
    whole = _take(StreamBatches(_source(sharded), CPU, config, finish, lambda line: None), plan, 0)
    assert len(whole) == (9 if sharded else 10)  # sharded: 13 per file, 3 whole micro-batches each
    first = StreamBatches(_source(sharded), CPU, config, finish, lambda line: None)
    assert _take(first, plan, 0, 4) == whole[:4]
    state = first.state_dict()
    assert state["kind"] == ("sharded stream" if sharded else "stream") and state["step_in_epoch"] == 4
    resumed = StreamBatches(_source(sharded), CPU, config, finish, lambda line: None)
    resumed.load_state_dict(state)
    assert _take(resumed, plan, 4) == whole[4:]


def test_a_sharded_position_at_another_world_size_is_one_line():
    config = load_config(None, ["data.num_workers=0"]).data
    batches = StreamBatches(_source(True), CPU, config, Finish(Normalizer((), (), False), None), print)
    saved = {"kind": "sharded stream", "world_size": 2, "num_workers": 0, "epoch": 0, "step_in_epoch": 3,
             "ranks": [{}, {}]}
    with pytest.raises(UserError, match=r"read by 2 ranks x 0 DataLoader workers; this run has 1 x 0") as error:
        batches.load_state_dict(saved)
    assert "\n" not in str(error.value) and "--nproc-per-node 2" in str(error.value)
    with pytest.raises(UserError, match="its data position is of a stream source, this run reads a sharded"):
        batches.load_state_dict({**saved, "kind": "stream"})
    with pytest.raises(UserError, match="its data position is of a sharded stream source, this run reads indexed"):
        load_source_state(DeviceBatches(Split(torch.zeros(4, 1), torch.zeros(4)), CPU), saved)


def test_a_stream_needs_train_max_steps_only_for_a_schedule_that_needs_its_length():
    with pytest.raises(ConfigError) as error:  # the default cosine, no train.schedule_steps
        count_steps(load_config(None, ["train.epochs=1"]), None)
    message = str(error.value)
    assert message.startswith("train.max_steps = 0: the training data is a stream") and "\n" not in message
    assert all(fix in message for fix in ("train.max_steps=N", "train.schedule_steps=N", "train.schedule=constant"))
    assert count_steps(load_config(None, ["train.max_steps=7"]), None) == 7
    # Nothing needs the length: train.epochs passes end the run (None: unknown until they do).
    assert count_steps(load_config(None, ["train.schedule=constant"]), None) is None
    assert count_steps(load_config(None, ["train.schedule_steps=40"]), None) is None


class Pairs(IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y)


@pytest.mark.timeout(300)
def test_fit_on_a_plain_stream_trains_as_the_same_samples_in_memory(tmp_path, capfd):
    """distrib.fit with a stream that yields the map-style run's first-epoch order: the same weights, bitwise; one
    pass (train.epochs = 1) ends the run at the stream's end, its partial global batch counted."""
    from distrib import fit
    from tests.helpers.support import load_weights

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g)
    test = (x[:40], y[:40])
    common = {"train.global_batch_size": 32, "train.warmup_steps": 2, "train.schedule": "constant",
              "run.progress": False, "dist.device": "cpu",
              "checkpoint.every_steps": 0, "data.num_classes": 3}
    order = BatchPlan(200, 32, 1, 0, 1, load_config(None, []).train.seed).order(0)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    memory = fit(model, (x, y), test, overrides={**common, "train.max_steps": 6, "train.epochs": 0,
                                                 "run.dir": str(tmp_path / "memory")})
    stream = fit(model, Pairs(x[order], y[order]), test,
                 overrides={**common, "train.max_steps": 100, "train.epochs": 1, "run.dir": str(tmp_path / "stream")})
    assert memory["steps"] == stream["steps"] == 6 and stream["epochs"] == 1
    weights = load_weights(tmp_path / "memory"), load_weights(tmp_path / "stream")
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    assert "stream pass 0 ended after 200 samples: 6 steps of 32 trained, the last 8" in capfd.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_a_finite_stream_with_a_constant_schedule_trains_by_passes(tmp_path, capfd, sharded):
    """No train.max_steps: 200 samples in global batches of 8 are 25 steps a pass; 2 passes are 50 steps, bitwise what
    train.max_steps = 50 gave; runs stopped at step 25 (a pass boundary) and 37 (mid-pass) and resumed by passes end
    there too (sharded: 4 files of 50, resumed from the position in the checkpoint)."""
    from distrib import fit
    from tests.helpers.support import load_weights

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g)
    common = {"train.global_batch_size": 8, "train.warmup_steps": 3, "train.schedule": "constant",
              "train.max_steps": 0, "train.log_every": 10, "run.progress": False, "dist.device": "cpu",
              "checkpoint.every_steps": 0, "data.num_classes": 3}

    def model():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def run(name: str, **overrides) -> dict:
        settings = {**common, "train.epochs": 2, "run.dir": str(tmp_path / name), **overrides}
        source = Shards(["0", "50", "100", "150"], lambda first: zip(x[int(first):int(first) + 50],
                                                                     y[int(first):int(first) + 50]))
        return fit(model, source if sharded else Pairs(x, y), (x[:40], y[:40]), overrides=settings)

    one = run("one", **{"train.epochs": 1})
    said = capfd.readouterr().err
    assert (one["steps"], one["epochs"], one["stop_reason"]) == (25, 1, "completed"), one
    assert "an unknown number of steps (train.epochs = 1 passes over the stream" in said, said
    assert ("stream pass 0 ended at step 25 of the pass, when a rank's shards ran dry: samples left untrained per "
            "rank [0]" if sharded else "stream pass 0 ended after 200 samples: 25 steps of 8 trained, none left "
            "over") in said, said
    two = run("two")
    reference = run("max_steps", **{"train.max_steps": 50})  # as a stream had to be given before
    assert two["steps"] == reference["steps"] == 50 and two["epochs"] == 2
    weights = load_weights(tmp_path / "two")
    assert all(torch.equal(weights[key], value) for key, value in load_weights(tmp_path / "max_steps").items())
    for stop in (25, 37):  # stopped by a train.max_steps, then resumed with none: it trains on to 50
        first = run(f"at_{stop}", **{"train.max_steps": stop})
        resumed = run(f"at_{stop}")
        assert (first["steps"], resumed["resumed_from_step"], resumed["steps"]) == (stop, stop, 50), resumed
        assert all(torch.equal(weights[key], value) for key, value in load_weights(tmp_path / f"at_{stop}").items())
    assert run("at_37")["steps"] == 50  # finished: trains nothing
    assert "the run is finished (50 steps in train.epochs = 2 passes done)" in capfd.readouterr().err
