"""The built-in GPT's mixture of experts: token-choice top-k routing over SwiGLU experts held as experts-first 3-D
tensors (computed with torch's grouped matmul), optional shared experts, a load-balancing loss and DeepSeek-V3's bias.

MoE.forward sorts its (token, choice) pairs by expert and calls exactly `self.experts(x_sorted, counts)` with the
global counts: expert parallel wraps that call (its all-to-alls) and replaces nothing else."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distrib.torch_private import current_graph_task_id

# The per-step statistics buffers (not in checkpoints): each rank's own until distrib.training.experts sums them.
STEP_BUFFERS = ("tokens_per_expert", "dropped_tokens", "aux_loss_sum")
# grouped_mm's rows' alignment: each row a multiple of 16 bytes
_ALIGN_BYTES = 16


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward refuses a strided one
    (as the expand of a sum or a transposed view gives)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x's rows of group e times weight[e].T ([E, out, in], nn.Linear's layout), for rows offsets[e-1]:offsets[e]."""
    return _ContiguousGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets))


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs, w2(silu(w1 x) * w3 x), as three tensors with the experts first (expert parallel
    shards dim 0): w1 and w3 [E, hidden, dim], w2 [E, dim, hidden]."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.n_experts, self.dim, self.hidden_dim = n_experts, dim, hidden_dim
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim], its rows sorted by expert, counts[e] of them expert e's -> [N, dim] (under autocast, in its
        dtype: grouped_mm is no autocast op, so operands are cast here as autocast casts a matmul's)."""
        autocast = x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)  # no autocast on meta
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        if self.grouped_mm_fits(x, dtype):
            x, w1, w3, w2 = (t.to(dtype) for t in (x, self.w1, self.w3, self.w2))
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            hidden = F.silu(_grouped(x, w1, offsets)) * _grouped(x, w3, offsets)
            return _grouped(hidden, w2, offsets)
        return self.loop(x, counts)

    def grouped_mm_fits(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        """Whether torch's grouped matmul takes these operands in `dtype` (x's by default): on CUDA bf16 from sm80
        on; on CPU bf16 and float32, but not under torch.compile, whose fake-tensor rule refuses float32; rows of
        16-byte multiples; and at least one row (its backward fails on none)."""
        dtype = dtype or x.dtype
        if not hasattr(F, "grouped_mm") or x.shape[0] == 0:
            return False
        if x.device.type == "cuda":
            fits = dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
        else:
            fits = dtype == torch.bfloat16 or (dtype == torch.float32 and not torch.compiler.is_compiling())
        size = torch.empty((), dtype=dtype).element_size()
        return fits and all(width * size % _ALIGN_BYTES == 0 for width in (self.dim, self.hidden_dim))

    def loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same product one expert at a time (where grouped_mm does not fit: float64, fp16, odd widths, no rows):
        every expert takes part in the graph, so each gets a gradient (zero when it had no rows)."""
        outs = []
        for e, rows in enumerate(x.split(counts.tolist())):
            hidden = F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)
            outs.append(hidden @ self.w2[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, self.dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x): the GPT's dense MLP, and the experts every token goes through (DeepSeek's
    shared experts, n_shared x the expert width)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recompute, which must not count its
    tokens twice."""
    return current_graph_task_id() != -1


class MoE(nn.Module):
    """x [..., dim] -> [..., dim]: each token to the top_k experts of its softmax router scores (expert_bias added
    for the choice only), the experts' outputs weighted by those scores (top_k > 1: renormalised to sum to 1, as
    Mixtral, Qwen3-MoE and DeepSeek-V3 do; measured here, a better loss and less collapse than the raw scores) and
    summed, plus the shared experts'.

    capacity_factor > 0 keeps at most ceil(capacity_factor x tokens x top_k / n_experts) pairs per expert (the first
    tokens win; a dropped pair adds nothing); 0 drops none. aux_loss_coef > 0: each forward leaves `aux_loss`, the
    Switch Transformer's balance loss over this call's tokens, n_experts x sum_e(f_e x P_e) x aux_loss_coef (f_e the
    share of pairs routed to e, P_e its mean score; under context parallel f_e is the whole sequences', see
    balance_loss). bias_update_rate > 0: DeepSeek-V3's auxiliary-loss-free balancing, expert_bias moved after each
    step by the global counts. Each training forward's counts accumulate in tokens_per_expert and dropped_tokens (not
    in checkpoints) until distrib.training.experts reads and clears them after the step."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, n_shared_experts: int = 0,
                 capacity_factor: float = 0.0, aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.bias_update_rate = bias_update_rate  # applied after each optimizer step (distrib.training.experts)
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden_dim)
        self.shared_experts = FeedForward(dim, hidden_dim * n_shared_experts) if n_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(n_experts))  # DeepSeek-V3's: in the checkpoint
        # int64: a float buffer would follow the model into bf16 and miscount past 256
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64), persistent=False)
        # under pipeline parallel: this step's aux losses x their gradient's scale, for the log (see add_aux_losses)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.aux_loss: torch.Tensor | None = None  # the last forward's, with its graph
        self.aux_grad_scale = 1.0  # its gradient under pipeline parallel: set each step (distrib.training.experts)

    def reset_parameters(self) -> None:
        """Clears the bias and the step's counts (GPT.reset_parameters initialises the weights)."""
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        self.dropped_tokens.zero_()
        self.aux_loss_sum.zero_()

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router scores [N, E] (fp32 softmax), and each token's top_k choices [N, k] and their weights [N, k]
        (top_k > 1: summing to 1)."""
        scores = F.softmax(self.gate(flat).float(), dim=-1)
        with torch.no_grad():
            choice = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(1, choice)
        return scores, choice, weights / weights.sum(-1, keepdim=True) if self.top_k > 1 else weights

    def dispatch(self, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, choice) pairs sorted by expert (stable: tokens in order within an expert), less those over
        capacity: their indices into choice.flatten() [M], and the kept counts per expert [E]; and the whole counts."""
        flat_choice = choice.flatten()
        order = torch.argsort(flat_choice, stable=True)
        # scatter_add_, not bincount: the same integer counts with a shape known before the values (a fake step's
        # recomputation under activation checkpointing cannot run bincount, whose length depends on them)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat_choice.device).scatter_add_(
            0, flat_choice, torch.ones_like(flat_choice))
        if self.capacity_factor <= 0:
            return order, counts, counts
        capacity = math.ceil(self.capacity_factor * flat_choice.numel() / self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[flat_choice[order]]
        return order[position < capacity], counts.clamp(max=capacity), counts

    def forward(self, x: torch.Tensor, sequence_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """sequence_group: the context-parallel group whose ranks hold the other cuts of x's sequences (the aux loss
        counts their choices too), None for whole sequences."""
        flat = x.reshape(-1, x.shape[-1])
        scores, choice, weights = self.route(flat)
        pairs, counts, wanted = self.dispatch(choice)
        tokens = pairs // self.top_k
        routed = self.experts(flat[tokens], counts)
        routed = routed * weights.flatten()[pairs].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, tokens, routed.to(flat.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        self.aux_loss = self.balance_loss(scores, wanted, sequence_group) if self.aux_loss_coef > 0 else None
        if torch.is_grad_enabled() and not _recomputing():  # training forwards only, each once
            with torch.no_grad():
                self.tokens_per_expert += counts
                self.dropped_tokens += (wanted - counts).sum()
        return out.view_as(x)

    def balance_loss(self, scores: torch.Tensor, wanted: torch.Tensor,
                     sequence_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """aux_loss_coef x E x sum_e(f_e x P_e) over this call's tokens (1 x coef when perfectly balanced). Under
        context parallel (sequence_group: the ranks holding the other cuts, as many tokens each) f_e is the whole
        sequences' (the counts summed over the group: integers, no gradient, the same on each of its ranks) and P_e
        this rank's: the group's mean of the value is the whole sequences' loss, and its C ranks' gradients, summed,
        C times the whole one's, as the loss's C shares a rank are (dimensions.context: loss_count)."""
        tokens = scores.shape[0]
        if sequence_group is not None:
            wanted = wanted.clone()
            dist.all_reduce(wanted, group=sequence_group)
            tokens *= dist.get_world_size(sequence_group)
        share = wanted.float() / (tokens * self.top_k)
        return self.aux_loss_coef * self.n_experts * (share * scores.mean(0)).sum()


class AddAuxiliaryLoss(torch.autograd.Function):
    """DeepSeek's: returns x; its backward also gives `loss` the gradient 1, so a loss computed inside a pipeline
    stage joins the backward that the stage's output receives (the schedule's loss is the last stage's only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.clone()  # not a view: a stage's output, which FSDP hooks (an in-place op on a view would skip it)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def add_aux_losses(x: torch.Tensor, moes: list[MoE]) -> torch.Tensor:
    """A pipeline stage's output with its MoE layers' aux losses in its backward, each x its aux_grad_scale (the
    share of the step a microbatch's loss has); their scaled values accumulate in aux_loss_sum for the log."""
    scaled = [(moe, moe.aux_loss * moe.aux_grad_scale) for moe in moes if moe.aux_loss is not None]
    if not scaled or not torch.is_grad_enabled():
        return x
    with torch.no_grad():
        for moe, loss in scaled:
            moe.aux_loss_sum += loss.detach().float()
    return AddAuxiliaryLoss.apply(x, torch.stack([loss for _, loss in scaled]).sum())
