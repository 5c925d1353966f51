"""What autograd saves for the backward of a forward on meta tensors, by storage (each once, the parameters left out):
a micro-batch's activation bytes, as is and with each block recomputed, and what the loss's backward holds beside."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.distributed.parallel import local_tensor
from distrib.torch_private import storage_id, view_base
from distrib.training.losses import Loss, cross_entropy, forward, own_loss


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def activation_bytes(model: nn.Module, inputs, targets, blocks: list[nn.Module], loss: Loss | None = None
                     ) -> tuple[int, int]:
    """Bytes autograd keeps for backward after one forward of this micro-batch (parameters not counted, each
    storage once): as is, and with each block recomputed (speed.activation_checkpointing = blocks: a block keeps
    only its input, and one block's own tensors live again while it is recomputed). The loss is the model's own where
    it returns one (as the trainer takes it), else `loss` (cross-entropy where none is given)."""
    loss = loss or cross_entropy()

    def forward_and_loss():
        outputs = forward(model, inputs)  # a dict sample as model(**inputs)
        if own_loss(outputs) is None or loss.whole:
            loss(outputs, targets)
            return getattr(outputs, "logits", outputs)
        return None

    whole, recomputed, logits = saved_bytes(forward_and_loss, model, blocks)
    transient = loss_gradient_bytes(logits) if isinstance(logits, torch.Tensor) else 0
    return whole + transient, recomputed + transient


def loss_gradient_bytes(logits: torch.Tensor) -> int:
    """What the loss's backward holds beside the saved tensors, at the step's peak when blocks are recomputed: the
    float32 gradient of the logits twice at once (cross-entropy's nll_loss gradient and log_softmax's), a tp rank's
    logits (whole where gathered)."""
    return 8 * local_tensor(logits).numel()


def saved_bytes(forward, model: nn.Module, blocks: list[nn.Module], skip: tuple[torch.Tensor, ...] = ()
                ) -> tuple[int, int, object]:
    """activation_bytes' count for any forward: the bytes autograd saves while `forward()` runs, neither the model's
    parameters nor the tensors in `skip` (each storage once); the same with each block recomputed; and what forward
    returned."""
    whole, kept, recomputed, returned = saved_parts(forward, model, blocks, skip)
    return whole, kept + recomputed, returned


def saved_parts(forward, model: nn.Module, blocks: list[nn.Module], skip: tuple[torch.Tensor, ...] = ()
                ) -> tuple[int, int, int, object]:
    """saved_bytes with each block recomputed in two parts: what stays until the backward (the blocks' inputs and
    what no block saves) and the most one block saves again while it is recomputed (once per rank, whatever number
    of microbatches a pipeline keeps in flight: one block recomputes at a time)."""
    params = {id(p) for p in model.parameters()}
    skipped = {storage_id(local_tensor(t)) for t in skip} | {storage_id(local_tensor(p)) for p in model.parameters()}
    saved: dict[tuple, tuple[int, int]] = {}  # storage -> (bytes, index of the block that saved it, -1: none)
    block_inputs, current = [], [-1]

    def pack(tensor):
        base, local = view_base(tensor), local_tensor(tensor)  # a split model's DTensors: this rank's slice
        if id(tensor) not in params and not (base is not None and id(base) in params) \
                and storage_id(local) not in skipped:
            key = (storage_id(local), local.storage_offset(), tuple(local.shape))
            saved.setdefault(key, (tensor_bytes(local), current[0]))
        return tensor

    def enter(index):
        def hook(module, args):
            current[0] = index
            block_inputs.append(sum(tensor_bytes(local_tensor(a)) for a in args if isinstance(a, torch.Tensor)))
        return hook

    handles = [block.register_forward_pre_hook(enter(i)) for i, block in enumerate(blocks)]
    handles += [block.register_forward_hook(lambda *_: current.__setitem__(0, -1)) for block in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            returned = forward()
    finally:
        for handle in handles:
            handle.remove()
    whole = sum(size for size, _ in saved.values())
    per_block = [sum(size for size, owner in saved.values() if owner == i) for i in range(len(blocks))]
    outside = whole - sum(per_block)
    return whole, outside + sum(block_inputs), max(per_block, default=0), returned
