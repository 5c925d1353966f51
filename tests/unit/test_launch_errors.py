"""What the launcher checks once, in the parent, before any worker starts: the global batch's split, the device, a
rule of the strategy, the layout (every parallel degree, the heads under tensor parallel), the script. Each is one
line and exit 2, and no worker is started (run_agent is never reached)."""

from __future__ import annotations

import pytest

import distrib.launch.launcher as launcher
from distrib.cli import main

# The built-in GPT with 2 heads under tensor parallel (fsdp on the other ranks), on the built-in text.
GPT_TP = ["--set", "dist.strategy=fsdp", "--set", "model.name=gpt", "--set", "model.kwargs={n_heads = 2, dim = 16}",
          "--set", "data.name=text"]


@pytest.fixture
def no_workers(monkeypatch):
    monkeypatch.setattr(launcher, "run_agent", lambda args: pytest.fail("a worker was started"))


@pytest.mark.parametrize("argv, line", [
    (["train", "--nproc-per-node", "2", "--set", "train.global_batch_size=63"],
     "distrib: error: train.global_batch_size = 63: must divide into world_size (2) x train.grad_accum_steps (1) = 2 "
     "equal micro-batches; use 62 or 64"),
    (["train", "--nproc-per-node", "2", "--set", "train.global_batch_size=64", "--set", "train.grad_accum_steps=3"],
     "distrib: error: train.global_batch_size = 64: must divide into world_size (2) x train.grad_accum_steps (3) = 6 "
     "equal micro-batches; use 60 or 66"),
    (["train", "--nproc-per-node", "2", "--set", "dist.device=cuda"],
     "distrib: error: dist.device = 'cuda': CUDA is not available on this machine; use --set dist.device=cpu "
     "(or auto)"),
    (["train", "--nproc-per-node", "2", "--set", "dist.cpu_offload=true"],
     "distrib: error: dist.cpu_offload = True: offloads FSDP shards, and dist.strategy is ddp; set --set "
     "dist.strategy=fsdp or --set dist.cpu_offload=false"),
    (["launch", "--nproc-per-node", "2", "nope.py"],
     "distrib: error: nope.py: no such script; give the path of a Python script, or -m MODULE (e.g. distrib launch "
     "--nproc-per-node 2 -m distrib train)"),
    (["train", "--nproc-per-node", "3", "--set", "dist.pipeline_parallel=2"],
     "distrib: error: dist.pipeline_parallel = 2: does not divide world size 3; use 1 or 3 (the divisors of 3), or a "
     "world size that is a multiple of 2"),
    (["train", "--nproc-per-node", "4", *GPT_TP, "--set", "dist.tensor_parallel=4"],
     "distrib: error: dist.tensor_parallel = 4: GPT's 2 attention heads (model.kwargs n_heads) cannot be split 4 ways "
     "(each rank computes whole heads); use dist.tensor_parallel = 1 or 2 (e.g. --set dist.tensor_parallel=2), or set "
     "model.kwargs n_heads to a multiple of 4"),
], ids=["global-batch", "grad-accum", "no-cuda", "strategy-rule", "no-script", "pipeline-degree", "heads"])
def test_the_launcher_checks_once_before_any_worker(argv, line, tmp_path, capfd, monkeypatch, no_workers):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, also on a GPU host
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--set", f"run.dir={tmp_path}/run"] if argv[0] == "train" else argv) == 2
    assert capfd.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, line", [
    (["train", "--nproc-per-node", "abc"],
     "distrib: error: distrib train --nproc-per-node 'abc': not a whole number; give one, e.g. --nproc-per-node 2 "
     "(see distrib train --help)"),
    (["launch", "--max-restarts", "abc", "x.py"],
     "distrib: error: distrib launch --max-restarts 'abc': not a whole number; give one, e.g. --max-restarts 2 "
     "(see distrib launch --help)"),
    (["launch", "--nproc-per-node", "abc", "x.py"],
     "distrib: error: --nproc-per-node 'abc': Unsupported nproc_per_node value: abc; give a number, or auto, cpu or "
     "gpu"),
    (["eval"], "distrib: error: distrib eval: the following arguments are required: RUN_DIR|CHECKPOINT; see distrib "
               "eval --help"),
], ids=["train-nproc", "launch-int", "launch-nproc", "missing"])
def test_a_wrong_argument_is_one_line_naming_the_flag_value_and_fix(argv, line, tmp_path, capfd, monkeypatch,
                                                                     no_workers):
    """Not argparse's usage text (7 lines for distrib train, 25 for torchrun's parser): one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert main(argv) == 2
    assert capfd.readouterr().err.splitlines() == [line]


def test_the_global_batch_splits_over_the_data_parallel_ranks_not_the_world(tmp_path, capfd, monkeypatch):
    """Tensor parallel 2 at world 4: 2 data-parallel ranks read different micro-batches, so a global batch of 2 splits
    (each worker's batch plan agrees); the launcher starts the workers."""
    started = []
    monkeypatch.setattr(launcher, "run_agent", lambda args: started.append(args) or 0)
    for name, unchanged in (("cpu_threads", None), ("worker_preload", {}), ("private_sockets", {})):
        monkeypatch.setattr(launcher, name, lambda *args, same=unchanged: same)  # this process's environment as is
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--nproc-per-node", "4", *GPT_TP, "--set", "dist.tensor_parallel=2", "--set",
                 "train.global_batch_size=2", "--set", f"run.dir={tmp_path}/run"]) == 0, capfd.readouterr().err
    assert len(started) == 1
