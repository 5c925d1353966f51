"""The dry run measured on a few blocks and counted for the rest. A rank's peak grows by the same bytes with each block
it holds when its blocks are alike (each adds its shards of parameters, gradients and optimizer state, and the
activations each microbatch in flight keeps of it); what is held once (the embeddings, the output layer, a block
gathered in flight, the loss) does not grow. So the dry run steps the model cut to 2 and then 3 blocks a stage (its
first ones, laid out over the same mesh) and extends the line through the two peaks, part by part, to the blocks the
rank holds: a 70B layout's stage of 10 blocks in the time of 5. (One block is off the line: the first block to run
backward is then also the last, and its buffers in flight are the root's.) A model whose blocks differ (dense and
mixture-of-experts layers mixed), or a rank that holds no more blocks than measured, is stepped whole."""

from __future__ import annotations

import torch.nn as nn

from distrib.config import Config
from distrib.distributed import fsdp, pipeline

MEASURED = (2, 3)  # blocks a stage in the two cut models


def block_list(model: nn.Module, config: Config) -> nn.ModuleList | None:
    """The list that holds the model's blocks (dist.shard_modules' modules), if they are alike (one class, the same
    parameter shapes) and all in one nn.ModuleList; else None: the model cannot be cut."""
    blocks = fsdp.find_blocks(model, config.dist.shard_modules)
    ids = [id(block) for block in blocks]
    holder = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == len(blocks)
                   and sorted(id(child) for child in m) == sorted(ids)), None)
    if holder is None or len({_signature(block) for block in blocks}) != 1:
        return None
    return holder


def _signature(block: nn.Module) -> tuple:
    return type(block), tuple((name, tuple(p.shape)) for name, p in block.named_parameters())


def cut(model: nn.Module, config: Config, count: int) -> nn.Module:
    """The model with its first `count` blocks only (on meta: nothing allocated). Hugging Face decoders run
    `layers[:config.num_hidden_layers]`, so fewer run as they are."""
    del block_list(model, config)[count:]
    return model


def stages(config: Config) -> int:
    """The pipeline's stages (1 without one): each holds the same blocks of a cut model."""
    dist = config.dist
    return dist.pipeline_parallel * dist.stages_per_rank if dist.pipeline_parallel > 1 else 1


def held_blocks(config: Config, num_blocks: int, pipeline_rank: int) -> int:
    """The blocks a pipeline rank holds of num_blocks: its stages' shares of the balanced split
    (distrib.distributed.pipeline.split), or all of them without a pipeline."""
    dist = config.dist
    if dist.pipeline_parallel == 1:
        return num_blocks
    count = stages(config)
    starts = [round(stage * num_blocks / count) for stage in range(count)] + [num_blocks]
    mine = pipeline.stages_of(pipeline_rank, dist.pipeline_parallel, dist.stages_per_rank,
                              dist.pipeline_schedule)
    return sum(starts[stage + 1] - starts[stage] for stage in mine)


def extended(first: dict, second: dict, measured: tuple[int, int], held: int) -> dict:
    """A rank's figures at `held` blocks from its figures at measured[0] and measured[1] blocks: each part on the
    line through the two, never below zero; the peak their sum. A pipeline's step turns, from all its microbatches in
    flight, to backwards that each free one and leave the gradients whole; each turn's peak grows by its own bytes a
    block, so the turn that peaks at 2 and 3 blocks need not at 5 (the 70B's first stage without checkpointing at 40
    layers: its second backward's end, accumulating the embedding's whole gradient again, at 2 and 3; its first's at
    5: read 4% low). So the peak so far at each turn ("phase_parts") has a line too; the highest at `held` is the
    peak."""
    low, high = measured

    def at(a: int, b: int) -> int:
        return max(0, round(a + (b - a) * (held - low) / (high - low)))

    lines = [{part: at(one[part], two[part]) for part in one}
             for one, two in zip([first["parts"], *first["phase_parts"]], [second["parts"], *second["phase_parts"]])]
    parts = max(lines, key=lambda line: sum(line.values()))
    return {**first, "peak_bytes": sum(parts.values()), "parts": parts,
            "measured_blocks": measured, "blocks": held}
