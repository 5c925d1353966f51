"""The fsdp strategy against references: ddp and one process (weights, metrics, model.pt, memory per rank), exact
and resharded resume from sharded checkpoints, a killed worker, a broken checkpoint, asynchronous writes cut short,
and the finite check when only one rank's shard goes NaN."""

import re

import pytest
import torch

from distrib.checkpoint.resume import choose, decide
from distrib.config import load_config
from distrib.distributed.strategies import check_config
from distrib.errors import ConfigError
from tests.helpers.support import REPO

# 203 test samples in batches of 50: 5 evaluation batches, 2 and 3 per rank at world size 2, so fsdp pads one.
BASE = ["data.name=synthetic", "data.synthetic_train_size=1536", "data.synthetic_test_size=203",
        "data.eval_batch_size=50", "run.progress=false", "train.global_batch_size=24", "train.grad_accum_steps=2",
        "train.grad_clip=0.5", "train.schedule=constant", "train.warmup_steps=3", "train.log_every=10",
        "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep_last=3", "dist.device=cpu",
        "dist.timeout_s=60"]
FSDP = ["dist.strategy=fsdp"]


def _sets(run_dir, *overrides) -> list[str]:
    return [a for o in [*BASE, f"run.dir={run_dir}", *overrides] for a in ("--set", o)]


@pytest.mark.parametrize("overrides, message", [
    (["dist.strategy=fsdp", "train.precision=fp16"], "train.precision = 'fp16': not supported with dist.strategy"),
    (["checkpoint.async_save=true"], "checkpoint.async_save = 'process': background saves write sharded"),
    (["dist.cpu_offload=true"], "dist.cpu_offload = True: offloads FSDP shards"),
    (["dist.strategy=zero"], "dist.strategy = 'zero': must be one of ddp, fsdp"),
    (["speed.activation_checkpointing=all"], "speed.activation_checkpointing = 'all': must be one of none, blocks"),
])
def test_fsdp_config_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(load_config(None, overrides))  # a key's own value in load_config; a strategy's rule in its class


def test_named_blocks_that_the_model_lacks_are_refused():
    from distrib.distributed.fsdp import find_blocks
    from distrib.models.network import Network

    assert [type(m).__name__ for m in find_blocks(Network(), ("Linear",))] == ["Linear"] * 3
    assert [type(m).__name__ for m in find_blocks(Network(), "auto")] == ["Conv2d", "Linear", "Linear", "Linear"]
    with pytest.raises(ConfigError, match=r"dist.shard_modules = \('Block',\): no module .* Conv2d, Linear"):
        find_blocks(Network(), ("Block",))


def test_only_the_runtime_names_the_accelerator():
    for name in ("distributed/fsdp.py", "checkpoint/sharded.py", "checkpoint/shard_dir.py", "distributed/parallel.py"):
        assert not re.search(r"cuda|nccl|gloo", (REPO / "distrib" / name).read_text().lower()), name


@pytest.mark.parametrize("factory, expected", [("pinned_buffer", "buffer offset is on meta"),
                                               ("forward_makes_meta", "forward() made a tensor elsewhere")])
def test_device_mismatch_listing_works_under_fsdp(capsys, tmp_path, factory, expected):
    from distrib import cli

    argv = ["train", *_sets(tmp_path, *FSDP, "train.max_steps=1", f"model.factory=tests.helpers.factories:{factory}")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "device mismatch, expected cpu" in err and expected in err


def test_fsdp_never_starts_over_silently_beside_ddp_checkpoints(tmp_path):
    from distrib.checkpoint.format import CheckpointError

    # A ddp checkpoint is one fsdp resumes now (distrib.checkpoint.policy); one it cannot read is damaged.
    (tmp_path / "step_00000010.pt").write_bytes(b"a ddp checkpoint")
    with pytest.raises(CheckpointError, match="nothing to resume, its 1 checkpoint\\(s\\) that could continue the run "
                                              "are damaged \\(the newest: checkpoint .*step_00000010.pt: unreadable"):
        decide("auto", "refuse", tmp_path, torch.device("cpu"), print)
    with pytest.raises(CheckpointError, match="step_00000010.pt: unreadable"):
        choose(str(tmp_path / "step_00000010.pt"), tmp_path, torch.device("cpu"), print)
    with pytest.raises(CheckpointError, match="no manifest.json, so it was never completed"):
        (tmp_path / "step_00000020").mkdir()
        choose(str(tmp_path / "step_00000020"), tmp_path, torch.device("cpu"), print)


def test_an_untied_embedding_and_output_layer_are_units_of_their_own():
    """Outside the blocks, a module whose own parameters are a large share of the model and its alone (an untied
    embedding, an output layer) is sharded as a unit of its own, not held gathered in the root's unit for the whole
    step; a table tied to another module stays in the root's."""
    from distrib.distributed.fsdp import find_blocks, leftover_units
    from distrib.models.gpt import GPT

    untied = GPT(vocab_size=256, seq_len=16, n_layers=2, n_heads=4, dim=64, tie_weights=False)
    assert leftover_units(untied, find_blocks(untied, "auto")) == [untied.tok_embeddings, untied.output]
    tied = GPT(vocab_size=256, seq_len=16, n_layers=2, n_heads=4, dim=64)
    assert leftover_units(tied, find_blocks(tied, "auto")) == []
