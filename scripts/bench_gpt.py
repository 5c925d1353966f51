"""The GPT in scripts/bench.py (--model gpt): the trainer's config for a byte-level GPT on a text file, and the
nanoGPT-style loop written by hand that it is timed against, doing the same arithmetic.

The hand loop is what nanoGPT's train.py does per step: gather windows of the byte stream into (x, y) by slicing,
model(x), cross-entropy over every position, backward, AdamW. Its windows are the trainer's own (the batch plan's
sample order, then each sample's hashed start), so both take the same steps from the same weights."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

GPT_KWARGS = {"n_layers": 4, "n_heads": 4, "dim": 128}  # ~0.43 s a step of 32 x 64 tokens on one CPU thread
LR = 1e-3


def docs_text() -> Path:
    """The default text of the GPT benchmarks: the repository's docs as one UTF-8 file (README.md, then docs/*.md
    sorted; about 140 KB, as the README alone was before docs/ took its text), written once per content to the
    temporary folder, atomically (several workers of gpu_check.py may ask at once)."""
    repo = Path(__file__).resolve().parents[1]
    data = b"".join(path.read_bytes() for path in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))])
    path = Path(tempfile.gettempdir()) / f"distrib-docs-{hashlib.sha256(data).hexdigest()[:12]}.txt"
    if not path.exists():
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_bytes(data)
        partial.replace(path)
    return path


def gpt_overrides(args) -> list[str]:
    """The data and model keys of the GPT runs (the common keys come from bench.common_overrides)."""
    kwargs = ", ".join(f"{key} = {value}" for key, value in GPT_KWARGS.items())
    return ["data.name=text", f"data.root={args.text}", f"data.seq_len={args.seq_len}", "model.name=gpt",
            f"model.kwargs={{{kwargs}}}", "train.optimizer=adamw", f"train.lr={LR}", "train.weight_decay=0.0"]


def byte_stream(args, runtime):
    """The training bytes, as the trainer's text source holds them."""
    from distrib.config import load_config
    from distrib.data.text import text_streams

    return text_streams(load_config(None, gpt_overrides(args)).data)[0]


class GptHandLoop:
    """nanoGPT's loop on distrib's GPT: plain DDP, windows sliced from the byte tensor, AdamW."""

    def __init__(self, args, runtime, stream):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from distrib.data import BatchPlan
        from distrib.distributed.strategies.materialise import build_whole
        from distrib.models.gpt import GPT

        # Seeded as every strategy builds a self-initialising model (seed, build, seed, init): the same initial weights
        model = build_whole(lambda: GPT(vocab_size=256, seq_len=args.seq_len, **GPT_KWARGS), seed=0)
        self.model = DDP(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.stream, self.seq_len = stream, args.seq_len
        self.plan = BatchPlan((len(stream) - 1) // args.seq_len, args.batch, 1, runtime.rank, runtime.world_size, 0)
        self.order, self.loss = None, None

    def batch(self, step: int):
        import torch

        from distrib.data.text import window_starts

        epoch, step_in_epoch = divmod(step, self.plan.steps_per_epoch)
        if step_in_epoch == 0:
            self.order = self.plan.order(epoch)
        indices = self.plan.micro_batches(self.order, step_in_epoch)[0]
        starts = window_starts(0, epoch, indices.numpy(), len(self.stream) - self.seq_len).tolist()
        x = torch.stack([self.stream[s:s + self.seq_len] for s in starts]).long()
        y = torch.stack([self.stream[s + 1:s + 1 + self.seq_len] for s in starts]).long()
        return x, y

    def step(self, step: int) -> None:
        import torch.nn.functional as F

        x, y = self.batch(step)
        logits = self.model(x)
        self.loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.optimizer.zero_grad(set_to_none=True)
        self.loss.backward()
        self.optimizer.step()

    def final_loss(self, world_size: int) -> float:
        import torch

        final = self.loss.detach()
        torch.distributed.all_reduce(final)
        return final.item() / world_size


class GptFsdpHandLoop(GptHandLoop):
    """The same loop under FSDP2 written by hand, without distrib: fully_shard on each Block, then on the root (as
    torchtitan and distrib shard), AdamW with foreach (torchtitan's choice). It bounds what distrib's fsdp can reach."""

    def __init__(self, args, runtime, stream):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from distrib.distributed.strategies.materialise import build_whole
        from distrib.models.gpt import GPT, Block

        super().__init__(args, runtime, stream)
        model = build_whole(lambda: GPT(vocab_size=256, seq_len=args.seq_len, **GPT_KWARGS), seed=0)
        mesh = init_device_mesh("cpu", (runtime.world_size,))
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            fully_shard(block, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0, foreach=True)
