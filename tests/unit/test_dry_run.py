"""distrib plan --dry-run, in process: one rank's real layout on a fake process group of 4 ranks and a step on fake
tensors give a peak and its parts (fsdp; pp 2 x fsdp 2, the first and the last stage's ranks); a layout that cannot
be built is one line. (Its peak against real runs: tests/integration/test_meta_build.py.)"""

import json
import re

import pytest

from distrib.cli import main
from distrib.config import load_config
from distrib.errors import ConfigError
from distrib.plan import Machine
from distrib.plan.dry_run import PART_NAMES, dry_run, rows

TINY = ["model.name=gpt", "data.name=text", "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32",
        "dist.device=cpu", "model.kwargs={n_layers = 4, n_heads = 4, dim = 32, tie_weights = false}",
        "train.optimizer=adamw", "train.global_batch_size=16"]


def _sets(*overrides: str) -> list[str]:
    return [a for s in (*TINY, *overrides) for a in ("--set", s)]


def test_the_dry_run_of_fsdp_measures_a_peak_and_its_parts(capsys):
    assert main(["plan", *_sets("dist.strategy=fsdp"), "--world-size", "4", "--dry-run", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    parts = {part: figures[f"dry_run_{part}_bytes"] for part in PART_NAMES}
    assert figures["dry_run_peak_bytes_per_rank"] == sum(parts.values()) > 0
    assert [rank["rank"] for rank in figures["dry_run_ranks"]] == [0]
    # rank 0's shards of the parameters (and the buffers), and AdamW's two moments of them (and its step counts)
    assert figures["parameter_bytes_per_rank"] <= parts["parameters"] < 1.1 * figures["parameter_bytes_per_rank"]
    assert parts["optimizer"] >= 2 * figures["parameter_bytes_per_rank"]
    assert parts["activations"] > 0 and parts["ddp_buckets"] == 0
    assert figures["memory_bytes_per_rank"] > 0  # the analytic plan's, beside it


def test_the_dry_run_of_a_pipeline_measures_the_first_and_the_last_stage(capsys):
    assert main(["plan", *_sets("dist.strategy=fsdp", "dist.pipeline_parallel=2"), "--world-size", "4",
                 "--dry-run", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    lines = "\n".join(f"{name} {value}" for name, value in rows(figures))  # under the table without --json
    for text in ("dry run peak / rank", "rank 0 (pipeline rank 0)", "rank 2 (pipeline rank 1)"):
        assert text in lines, text
    ranks = figures["dry_run_ranks"]
    assert [(rank["rank"], rank["pipeline_rank"]) for rank in ranks] == [(0, 0), (2, 1)]
    assert figures["dry_run_peak_bytes_per_rank"] == max(rank["peak_bytes"] for rank in ranks) > 0
    # the first stage peaks in its backwards: its parameters gathered, its microbatches' activations in flight
    assert ranks[0]["parts"]["unsharded_parameters"] > 0 and ranks[0]["parts"]["activations"] > 0
    assert all(rank["parts"]["optimizer"] > 0 for rank in ranks)


@pytest.mark.parametrize("overrides, message", [
    (["dist.strategy=fsdp", "dist.tensor_parallel=3"], "dist.tensor_parallel = 3: does not divide world size 4"),
    (["dist.strategy=fsdp", "dist.pipeline_parallel=4", "model.kwargs={n_layers = 2, n_heads = 4, dim = 32}"],
     "dist.pipeline_parallel = 4 x 1 stage(s) per rank = 4 stages: more than GPT's 2 blocks"),
])
def test_a_layout_that_cannot_be_built_is_one_line(overrides, message, capsys):
    with pytest.raises(ConfigError, match=re.escape(message)):
        dry_run(load_config(None, [*TINY, *overrides]), Machine(1, 4))
    assert main(["plan", *_sets(*overrides), "--world-size", "4", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
