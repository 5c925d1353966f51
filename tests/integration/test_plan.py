"""distrib plan for real-sized models: GPTs of 1B and 8B parameters at 128 nodes x 8 on the meta device (the process
never holds their weights) and the table it prints; and under pipeline parallel against real runs (pp 2 x fsdp 2):
their state_bytes_per_rank exactly, and each pipeline rank's peak. (Its state_bytes_per_rank against other real runs:
tests/integration/test_resume_matrix.py; its arithmetic and refusals: tests/unit/test_plan.py.)"""

import json
import sys

import numpy as np
import pytest

from distrib.cli import main
from distrib.config import load_config
from distrib.plan import Machine, plan_run
from tests.helpers.launch_runs import torchrun_runs
from tests.helpers.support import REPO, assert_ok, run

# Llama-like shapes: 1B (2048 wide, 16 layers) and 8B (4096 wide, 32 layers, SwiGLU 14336), GPT-2's padded vocabulary.
GPTS = {"1B": "{n_layers=16, n_heads=16, dim=2048, hidden_dim=8192, tie_weights=true}",
        "8B": "{n_layers=32, n_heads=32, dim=4096, hidden_dim=14336, tie_weights=false}"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    np.zeros(1100 * 1024, dtype=np.uint16).tofile(root / "train.bin")  # room for one global batch of 1024 windows
    np.zeros(4096, dtype=np.uint16).tofile(root / "val.bin")
    return root


def _gpt_plan(tokens, size: str, *extra: str) -> list[str]:
    sets = ["data.name=tokens", f"data.root={tokens}", "data.vocab_size=50304", "data.seq_len=1024",
            "model.name=gpt", f"model.kwargs={GPTS[size]}", "train.global_batch_size=1024", "train.precision=bf16",
            "train.optimizer=adamw", "dist.strategy=hsdp", *extra]
    return ["plan", *[a for s in sets for a in ("--set", s)]]


# The CLI in a child that reports its own peak resident memory (KiB) on its last stderr line.
PEAK = ("import resource, sys; from distrib.cli import main; code = main(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size, billions", [("1B", 0.9), ("8B", 8.0)])
def test_a_gpt_at_128_nodes_is_planned_on_the_meta_device(tokens, size, billions):
    done = run([sys.executable, "-c", PEAK, *_gpt_plan(tokens, size), "--nnodes", "128", "--nproc-per-node", "8",
                "--json"], timeout=500)
    assert done.returncode == 0, done.stderr
    peak_bytes = int(done.stderr.split()[-1]) * 1024
    figures = json.loads(done.stdout)
    assert figures["num_parameters"] > billions * 1e9 and figures["world_size"] == 1024
    assert figures["mesh"] == {"replicate": 128, "shard": 8}
    # AdamW on fp32 shards of one node's eighth: parameters, gradients, two moments (and no CPU step counters)
    assert figures["state_bytes_per_rank"] == pytest.approx(16 * figures["num_parameters"] / 8, rel=0.01)
    assert (figures["micro_batch_size"], figures["grad_accum_steps"], figures["data_parallel_size"]) == (1, 1, 1024)
    assert figures["collective_bytes_per_step_inter_node"] > 0 and figures["step_seconds_lower_bound"] > 0
    assert peak_bytes < figures["num_parameters"] * 4 / 2  # never near one fp32 copy of the weights: meta only


def test_the_table_names_every_figure(tokens, capsys):
    assert main([*_gpt_plan(tokens, "1B", "speed.activation_checkpointing=blocks"),
                 "--nnodes", "2", "--nproc-per-node", "8", "--device-memory", "141"]) == 0
    out = capsys.readouterr().out
    for row in ("parameters / rank", "gradients / rank", "optimizer state / rank", "state_bytes_per_rank",
                "activations / micro-batch", "with activation checkpointing", "grad-accum steps", "intra-node",
                "inter-node", "fits", "of 141.00 GiB", "step time >="):
        assert row in out, row


def test_plan_is_a_command_of_the_cli():
    assert "plan" in run([sys.executable, "-m", "distrib", "--help"], timeout=60, cwd=REPO).stdout



# pp 2 x fsdp 2 at world size 4: a tiny GPT under 1f1b (also the baseline of the peaks), a 25.9M-parameter one (103 MB
# in fp32, untied: a pipeline splits the embedding from the output layer), the tiny one interleaved (4 stages).
PP = ["model.name=gpt", "data.name=text", "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32",
      "train.optimizer=adamw", "train.global_batch_size=16", "train.max_steps=2", "train.epochs=0",
      "train.eval_every_epochs=0", "run.progress=false", "dist.device=cpu", "dist.strategy=fsdp",
      "dist.pipeline_parallel=2"]
PP_RUNS = {"tiny": ["model.kwargs={n_layers = 4, n_heads = 4, dim = 32, tie_weights = false}"],
           "medium": ["model.kwargs={n_layers = 8, n_heads = 8, dim = 512, tie_weights = false}"],
           "interleaved": ["model.kwargs={n_layers = 4, n_heads = 4, dim = 32, tie_weights = false}",
                           "dist.pipeline_schedule=interleaved_1f1b"]}


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> dict:
    """The three runs in one launch of 4 workers (tests/helpers/train_runs.py), each rank's peak resident memory
    after each: {name: (summary, [peak bytes of rank 0..3])}."""
    root = tmp_path_factory.mktemp("pipeline")
    runs = {name: [*PP, *extra, f"run.dir={root / name}"] for name, extra in PP_RUNS.items()}
    assert_ok(torchrun_runs(4, runs, root, env={"TRAIN_RUNS_PEAKS": str(root)}))
    peaks = [json.loads((root / f"peaks_{rank}.json").read_text()) for rank in range(4)]
    return {name: (json.loads((root / name / "summary.json").read_text()), [peak[name] for peak in peaks])
            for name in runs}


@pytest.mark.timeout(900)
def test_plan_gives_a_pipeline_runs_state_exactly_and_its_bubble(pipeline_runs, capsys):
    for name, (summary, _) in pipeline_runs.items():
        assert main(["plan", *[a for s in (*PP, *PP_RUNS[name]) for a in ("--set", s)], "--world-size", "4",
                     "--json"]) == 0
        figures = json.loads(capsys.readouterr().out)
        assert figures["state_bytes_per_rank"] == summary["state_bytes_per_rank"], name
        # (P - 1) / (M + P - 1), M = 2 stages' microbatches; interleaved (P - 1) / (V M + P - 1), V = 2, M = 4
        assert figures["bubble_share"] == pytest.approx(1 / 9 if name == "interleaved" else 1 / 3), name


@pytest.mark.timeout(900)
def test_plan_tells_each_pipeline_ranks_peak(pipeline_runs, monkeypatch):
    """The 25.9M GPT's peak above the tiny one's, on each rank but rank 0 (which also gathers the whole model for
    model.pt at the end), within 50% of what plan says its pipeline rank holds: its state, its stage's parameters
    gathered and gradients unsharded through the step, its activations in flight (about 2x the state's 99 MiB)."""
    monkeypatch.setenv("DISTRIB_HOST_ALLOCATOR", "glibc")  # torchrun's workers: glibc with distrib's thresholds
    planned = {name: plan_run(load_config(None, [*PP, *PP_RUNS[name]]), Machine(1, 4))["stages"]
               for name in ("tiny", "medium")}
    measured = [m - t for m, t in zip(pipeline_runs["medium"][1], pipeline_runs["tiny"][1])]
    for rank in (1, 2, 3):
        pipeline_rank = rank // 2  # pp is the outermost dimension
        expected = planned["medium"][pipeline_rank]["memory_bytes"] - planned["tiny"][pipeline_rank]["memory_bytes"]
        print(f"rank {rank}: measured {measured[rank] / 2**20:.1f} MiB, plan {expected / 2**20:.1f} MiB")
        assert abs(measured[rank] - expected) <= 0.5 * measured[rank], (rank, measured, expected)
