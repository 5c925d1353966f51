"""speed.compile in one process, without compiling anything (no forward runs): which modules each strategy compiles
and the log's line, state-dict names without `_orig_mod.`, and a model dynamo cannot trace refused in one line before
anything is written. (Compiled against eager training under fsdp and tensor parallel:
tests/integration/test_compile.py)"""

import pytest
import torch.nn as nn

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed.compile import compile_blocks, compiled_classes
from distrib.distributed.fsdp import find_blocks
from distrib.distributed.parallel import unwrap
from distrib.distributed.runtime import open_runtime
from distrib.distributed.strategies import Build, make_strategy
from distrib.distributed.strategies.materialise import build_whole
from distrib.models.gpt import GPT

COMPILE = SpeedConfig(compile=True)


def _gpt():
    return GPT(n_layers=2, dim=32)


@pytest.mark.parametrize("strategy, line", [
    ("fsdp", "speed.compile: compiled 2 Block blocks, each in place before sharding, mode default; its warm-up "
             "(compiling in the first steps) stays out of samples/s (metrics.timing_skip_steps)"),
    ("ddp", "speed.compile: compiled the whole GPT over DDP (its graphs split at DDP's gradient buckets), mode "
            "default; its warm-up (compiling in the first steps) stays out of samples/s (metrics.timing_skip_steps)"),
])
def test_compiled_models_keep_their_state_dict_names_and_say_what_was_compiled(strategy, line):
    with open_runtime(DistConfig(device="cpu")) as runtime:
        chosen = make_strategy(DistConfig(strategy=strategy), 1, 1)
        lines = []
        model = chosen.setup_module(Build(_gpt, 3, speed=COMPILE, log=lines.append), runtime)
        whole = chosen.full_model_state(model)
        names = list(unwrap(model).state_dict())
    reference = list(build_whole(_gpt, 3).state_dict())
    assert names == list(whole) == reference and not any("_orig_mod" in name for name in names)
    assert lines == [line]
    # fsdp: each Block compiled in place (the root and its other modules are not); ddp: compiled over DDP
    assert compiled_classes(unwrap(model)) == (["Block"] if strategy == "fsdp" else [])
    assert hasattr(model, "_orig_mod") == (strategy == "ddp")


def test_only_the_outermost_blocks_are_compiled_and_a_model_without_blocks_whole():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    line = compile_blocks(model, find_blocks(model, ("Sequential", "Linear")), COMPILE)
    assert line.startswith("speed.compile: compiled 1 Linear and 1 Sequential blocks, each in place before sharding")
    assert compiled_classes(model) == ["Sequential", "Linear"] and model[0][0]._compiled_call_impl is None
    bare = nn.Linear(2, 2)
    line = compile_blocks(bare, [], SpeedConfig(compile=True, compile_mode="max-autotune"))
    assert line.startswith("speed.compile: compiled the whole Linear (dist.shard_modules found no blocks) in place "
                           "before sharding, mode max-autotune;")
    assert compiled_classes(bare) == ["Linear"]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_model_dynamo_cannot_trace_is_one_line(tmp_path, capsys, strategy):
    """Under fsdp the pre-flight dry batch compiles the blocks, before anything is written; under ddp (compiled over
    DDP, which the dry batch runs without) the first step's forward."""
    from distrib import cli

    sets = ["data.name=synthetic", "data.synthetic_train_size=64", "data.synthetic_test_size=16", "dist.device=cpu",
            "train.global_batch_size=8", f"dist.strategy={strategy}", "speed.compile=true", "train.max_steps=1",
            "run.progress=false", f"run.dir={tmp_path / 'run'}", "model.factory=tests.helpers.factories:untraceable"]
    assert cli.main(["train", *[item for each in sets for item in ("--set", each)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    compiled = "_Untraceable" if strategy == "fsdp" else "Sequential"  # the block compiled, or the whole model
    assert err.startswith(f"distrib: error: speed.compile = true: torch.compile cannot take {compiled} "
                          "(TorchRuntimeError: ")
    assert "distrib_tests.doubled" in err and err.endswith(
        "fix: --set speed.compile=false, or make the model traceable (docs/performance.md, Compiling)")
    if strategy == "fsdp":
        assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
