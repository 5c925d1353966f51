"""Builds a config's model as its strategy does (distrib.distributed.strategies), under torchrun, and writes what
rank 0 gathers of the weights (OUT/weights.pt) and each rank's peak resident memory (OUT/rss_RANK.json) after
building; with N steps, the weights and the peak after N steps that follow (the byte-level GPT on random tokens, the
config's optimizer as train builds it, no trainer): for the tests that sharded runs start from one process's weights,
hold no whole model, and hold what `distrib plan` says. Several probes run in turn in one launch (its start-up paid
once), each in a process group of its own; a peak is the process's so far, so a small probe before a large one makes
the large one's baseline.

argv: PROBES.json, a list of [OUT, N, [section.key=value, ...]]"""

import json
import resource
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from distrib.config import load_config
from distrib.data import load_data
from distrib.distributed.runtime import open_runtime
from distrib.distributed.strategies import Build, make_strategy
from distrib.models.build import build_model
from distrib.training.optimizers import build_optimizer


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def train_steps(model: torch.nn.Module, steps: int, config) -> None:
    """Forward, backward and a step of the config's optimizer on the same 2 windows of random bytes on every rank (so
    any world size trains the weights one process does): a training step's gathers, gradients and optimizer state."""
    optimizer, seq_len = build_optimizer(model, config.train), config.data.seq_len
    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def probe(out: Path, steps: int, overrides: list[str]) -> None:
    config = load_config(None, overrides)
    with open_runtime(config.dist) as runtime:
        strategy = make_strategy(config.dist, runtime.world_size, runtime.local_world_size)
        data = load_data(config.data, runtime, config.train.seed, log=lambda message: None)
        lines = []
        model = strategy.setup_module(Build(lambda: build_model(config.model, data.info), config.train.seed,
                                            log=lines.append), runtime)
        built = peak_rss()
        train_steps(model, steps, config)
        figures = {"peak_rss_bytes": built, "steps_peak_rss_bytes": peak_rss(), "log": lines}
        weights = strategy.full_model_state(model)  # after the peaks: rank 0 gathers the whole model
        if runtime.is_main:
            torch.save(weights, out / "weights.pt")
        (out / f"rss_{runtime.rank}.json").write_text(json.dumps(figures))


if __name__ == "__main__":
    for out, steps, overrides in json.loads(Path(sys.argv[1]).read_text()):
        probe(Path(out), steps, overrides)
