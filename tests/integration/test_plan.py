"""distrib plan for real-sized models: GPTs of 1B and 8B parameters at 128 nodes x 8 on the meta device (the process
never holds their weights) and the table it prints. (Its state_bytes_per_rank against real runs:
tests/integration/test_resume_matrix.py, and under pipeline parallel, with each pipeline rank's peak, in the
pipeline's launch: tests/integration/test_pipeline.py; its arithmetic and refusals: tests/unit/test_plan.py.)"""

import json
import sys

import numpy as np
import pytest

from distrib.cli import main
from tests.helpers.support import REPO, run

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


# The CLI in one child that plans each [OUT, [ARGS]] of argv[1] (its output to OUT) and says, on a stderr line after
# each, its exit code and its peak resident memory so far (KiB): the sizes share the child's start-up.
PEAK = ("import contextlib, json, resource, sys; from distrib.cli import main\n"
        "for out, args in json.loads(sys.argv[1]):\n"
        "    with open(out, 'w') as f, contextlib.redirect_stdout(f):\n"
        "        code = main(args)\n"
        "    print('peak', code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr, flush=True)")


@pytest.fixture(scope="module")
def planned(tokens, tmp_path_factory) -> dict[str, tuple[int, int, dict]]:
    """{size: (exit code, the child's peak resident bytes once it has planned it, its figures)}: the smaller first,
    so that its peak is its own."""
    out = tmp_path_factory.mktemp("planned")
    plans = [[str(out / f"{size}.json"), [*_gpt_plan(tokens, size), "--nnodes", "128", "--nproc-per-node", "8",
                                          "--json"]] for size in GPTS]
    done = run([sys.executable, "-c", PEAK, json.dumps(plans)], timeout=500)
    assert done.returncode == 0, done.stderr
    peaks = [line.split()[1:] for line in done.stderr.splitlines() if line.startswith("peak ")]
    assert len(peaks) == len(GPTS), done.stderr
    return {size: (int(code), int(kib) * 1024, json.loads((out / f"{size}.json").read_text()) if code == "0" else {})
            for size, (code, kib) in zip(GPTS, peaks)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size, billions", [("1B", 0.9), ("8B", 8.0)])
def test_a_gpt_at_128_nodes_is_planned_on_the_meta_device(planned, size, billions):
    code, peak_bytes, figures = planned[size]
    assert code == 0
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


def test_the_dry_run_bench_prints_its_table():
    """scripts/bench_dry_run.py on its smallest work (a tiny Llama of 8 blocks, fsdp over 1,024 ranks, a CUDA
    target): its header and the layout's row with the time, the resident peak, the rank's peak and the verdict."""
    done = run([sys.executable, "scripts/bench_dry_run.py", "--layouts", "tiny"], timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.strip().splitlines()
    assert header.split()[:4] == ["layout", "seconds", "peak", "RSS"] and "verdict" in header
    assert row.split()[0] == "tiny" and " fits " in row


def test_the_plan_matrix_bench_prints_its_ratios():
    """scripts/bench_plan_matrix.py on its smallest work (the tiny Llama under fsdp, without and with checkpointing):
    its header with the ratio column, and each row's plan and dry-run peaks with their ratio, plan / dry run."""
    done = run([sys.executable, "scripts/bench_plan_matrix.py", "--rows", "tiny"], timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.strip().splitlines()
    assert header.split() == ["layout", "ckpt", "plan", "dry", "run", "ratio", "15%", "seconds"]
    assert [row.split()[:2] for row in rows] == [["tiny", "off"], ["tiny", "blocks"]]
    for row in rows:
        plan, dry, ratio = float(row.split()[2]), float(row.split()[4]), float(row.split()[6])
        assert dry > 0 and ratio > 0 and (plan == 0 or abs(plan / dry - ratio) < 0.5), row
