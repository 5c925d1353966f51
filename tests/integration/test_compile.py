"""speed.compile against eager training of the built-in GPT at world size 2 (gloo), the four runs in one launch of 2
workers: under tensor parallel 2 with fsdp, and under pipeline parallel 2 (each Block compiled in place after tensor
parallel, before fully_shard; under pipeline parallel, each rank its own stage's: the one parallelize's compile step,
so fsdp alone takes the same path), the same weights, final train loss and test loss within float noise, the log's
line on what was compiled, and the compiling steps left out of the throughput figures. (No forward compiled, and the
one-line refusal of a model dynamo cannot trace: tests/unit/test_compile.py)"""

import json
from pathlib import Path

import pytest

from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it: 35 kB of English prose
GPT = ["model.name=gpt", "model.kwargs={n_layers = 4, n_heads = 4, dim = 64}", "data.name=text",
       f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=3",
       "train.max_steps=6", "train.global_batch_size=16", "train.epochs=0", "train.eval_every_epochs=0",
       "checkpoint.every_steps=0", "train.grad_clip=0.5", "run.progress=false", "dist.device=cpu"]
UNTIED = "model.kwargs={n_layers = 4, n_heads = 4, dim = 64, tie_weights = false}"  # each stage its own end
STRATEGIES = {"tp": ["dist.strategy=fsdp", "dist.tensor_parallel=2"],
              "pp": ["dist.strategy=ddp", "dist.pipeline_parallel=2", UNTIED]}
BLOCKS = {"tp": 4, "pp": 2}  # what the logging rank compiles: under pipeline parallel 2, its stage's


def line(blocks: int) -> str:
    return (f"speed.compile: compiled {blocks} Block blocks, each in place before sharding, mode default; its warm-up "
            "(compiling in the first steps) stays out of samples/s (metrics.timing_skip_steps)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Each strategy eager, then compiled, in one launch (its workers import dynamo and inductor once): the folder of
    the runs (STRATEGY_eager, STRATEGY_compiled) and each one's part of rank 0's stderr. (Once measured: four runs of
    12 steps in one launch, 380 s of its 420 s limit with a cold compile cache on a loaded machine; these four of 6
    steps, 190 s with a cold cache at a load of 8 on 2 cores, where the two launches of 12 steps took 187 s at 6.)"""
    tmp = tmp_path_factory.mktemp("compile")
    runs = {f"{strategy}_{name}": [*GPT, f"run.dir={tmp / f'{strategy}_{name}'}", *layout, *extra]
            for strategy, layout in STRATEGIES.items()
            for name, extra in (("eager", []), ("compiled", ["speed.compile=true"]))}
    done = torchrun_runs(2, runs, tmp)
    assert_ok(done)
    return tmp, split_runs(done.stderr, list(runs))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_compiled_blocks_train_like_eager(runs, strategy):
    """Measured over 12 steps: 2.1e-6 (fsdp), 6.5e-7 (tp) and 3.5e-6 (pp) largest relative weight difference, the
    same train loss to 7 digits, test losses 1e-8 apart."""
    tmp, logs = runs
    names = {name: f"{strategy}_{name}" for name in ("eager", "compiled")}
    eager, compiled = (json.loads((tmp / run / "summary.json").read_text()) for run in names.values())
    assert compiled["steps"] == eager["steps"] == 6 and compiled["world_size"] == 2
    weights = {name: load_weights(tmp / run) for name, run in names.items()}
    assert list(weights["compiled"]) == list(weights["eager"])  # model.pt's names: no _orig_mod. prefix
    assert max_relative_diff(weights["compiled"], weights["eager"]) < 1e-5
    assert compiled["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-5)
    assert compiled["test_loss"] == pytest.approx(eager["test_loss"], rel=1e-5)
    assert compiled["test_count"] == eager["test_count"] > 0
    assert line(BLOCKS[strategy]) in logs[names["compiled"]] and "speed.compile" not in logs[names["eager"]]
    # metrics.timing_skip_steps (5), at most half of a run's steps: step 1, which compiled, is not timed
    assert compiled["timed_steps"] == 6 - 3
