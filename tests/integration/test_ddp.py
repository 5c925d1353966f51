"""DDP against references: a plain single-process loop (bitwise) and gradient accumulation. (Other world sizes against
one process: test_fsdp.py's ddp run at world size 2, its fsdp resume at 3, and test_user_code.py.)"""


import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from distrib.config import DistConfig, load_config
from distrib.data import BatchPlan, DeviceBatches, load_splits, normalize
from distrib.distributed.agreement import RankAgreement
from distrib.distributed.parallel import place_model
from distrib.distributed.parallelize import wrap_ddp
from distrib.distributed.runtime import open_runtime
from distrib.launch.preempt import StopFlag
from distrib.metrics import Recorder
from distrib.models.network import Network
from distrib.training.losses import cross_entropy
from distrib.training.optimizers import lr_factor
from distrib.training.state import new_state
from distrib.training.throughput import Throughput
from distrib.training.trainer import Trainer
from distrib.worker import run_training
from tests.helpers.support import SMALL, load_weights, max_relative_diff

SYNTHETIC = [*SMALL, "data.synthetic_train_size=1536", "data.synthetic_test_size=200", "train.log_every=5",
             "train.warmup_steps=3"]


def _config(run_dir, *overrides):
    return load_config(None, [*SYNTHETIC, f"run.dir={run_dir}", *overrides])


def _plain_reference(config) -> dict:
    """The loop a user would write by hand: no DDP, no process group, same seed, samples and schedule."""
    cfg = config.train
    train, _ = load_splits(config.data, runtime=None)
    plan = BatchPlan(len(train), cfg.global_batch_size, cfg.grad_accum_steps, 0, 1, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = Network()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.max_steps, cfg))
    step, epoch = 0, 0
    while step < cfg.max_steps:
        order = plan.order(epoch)
        for step_in_epoch in range(plan.steps_per_epoch):
            for idx in plan.micro_batches(order, step_in_epoch):
                loss = F.cross_entropy(model(normalize(train.inputs[idx])), train.targets[idx]) / cfg.grad_accum_steps
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            if step == cfg.max_steps:
                break
        epoch += 1
    return model.state_dict()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("accum", [1, 2])
def test_one_process_ddp_equals_plain_loop_bitwise(tmp_path, accum):
    # 40 steps of 64 cross an epoch boundary (24 steps per epoch), so the reshuffle is covered too.
    config = _config(tmp_path, "train.max_steps=40", "train.global_batch_size=64", f"train.grad_accum_steps={accum}")
    summary = run_training(config)
    assert summary["steps"] == 40 and summary["epochs"] == 1 and summary["world_size"] == 1
    reference = _plain_reference(config)
    trained = load_weights(tmp_path)
    assert list(trained) == list(reference)  # unwrapped: no "module." prefix
    for name in reference:
        assert torch.equal(trained[name], reference[name]), name


@pytest.mark.timeout(900)
def test_accumulation_matches_a_bigger_micro_batch(tmp_path):
    one = run_training(_config(tmp_path / "a", "train.max_steps=20", "train.global_batch_size=8",
                                       "train.grad_accum_steps=1"))
    two = run_training(_config(tmp_path / "b", "train.max_steps=20", "train.global_batch_size=8",
                                       "train.grad_accum_steps=2"))
    assert one["steps"] == two["steps"] == 20
    diff = max_relative_diff(load_weights(tmp_path / "b"), load_weights(tmp_path / "a"))
    assert diff < 1e-6, diff


@pytest.mark.timeout(900)
def test_non_final_micro_steps_make_no_all_reduce(tmp_path):
    config = _config(tmp_path, "train.max_steps=4", "train.global_batch_size=16")
    with open_runtime(DistConfig(device="cpu")) as runtime:
        train, _ = load_splits(config.data, runtime)
        source = DeviceBatches(train, runtime)
        counts = {}
        for accum in (1, 4):
            torch.manual_seed(0)
            model = wrap_ddp(place_model(Network(), runtime.device), runtime)
            calls = []
            model.register_comm_hook(None, lambda state, bucket: calls.append(1) or
                                     default_hooks.allreduce_hook(None, bucket))
            plan = BatchPlan(len(train), 16, accum, 0, 1, 0)
            trainer = Trainer(state=new_state(model, config.train, 4, runtime.device), loss=cross_entropy(),
                              config=config.train, device=runtime.device, plan=plan, total_steps=4, evaluate=None,
                              recorder=Recorder(tmp_path, enabled=False),
                              meter=Throughput(16, 1), agreement=RankAgreement(StopFlag(), runtime.device, 1),
                              checkpointer=None)
            micro = list(source.batches(plan.micro_batches(plan.order(0), 0)))
            assert len(micro) == accum
            trainer.step(micro)
            counts[accum] = len(calls)
    assert counts[1] > 0 and counts[4] == counts[1]  # one bucketed all-reduce per step, not one per micro-step
