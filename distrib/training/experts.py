"""Each step's expert load of a mixture-of-experts model (distrib.models.moe, or a transformers MoE's fused experts:
RoutedTokens): after the optimizer step, one all-reduce of every MoE layer's tokens per expert and dropped tokens (and
under pipeline parallel its aux loss, for the log), then DeepSeek-V3's bias update from the global counts, and on log
steps the figures: expert_imbalance and dropped_tokens; and the start-up line naming the experts' layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.distributed.expert_modules import Experts, find_experts
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import unwrap
from distrib.errors import ConfigError
from distrib.models.moe import MoE, _recomputing


def split_experts(model: nn.Module) -> dict[str, Experts]:
    """The experts modules of a form expert parallel splits (find_experts: the built-in GPT's, transformers' fused
    ones); {} for a model without, or with experts of another form."""
    try:
        return find_experts(model, 1)
    except ConfigError:
        return {}


def top_k_of(layer: nn.Module) -> int:
    """The experts a token goes to in the MoE layer `layer`: its top_k (the GPT's, Mixtral's), its router's
    (Qwen3-MoE's gate), its config's num_experts_per_tok; 1 where none says."""
    for holder in (layer, getattr(layer, "gate", None), getattr(layer, "router", None)):
        if isinstance(getattr(holder, "top_k", None), int):
            return holder.top_k
    return getattr(getattr(layer, "config", None), "num_experts_per_tok", 1)


class RoutedTokens:
    """A transformers MoE layer's load, kept as the built-in MoE keeps its own (tokens_per_expert, dropped_tokens,
    aux_loss_sum): each training forward's (token, choice) pairs per expert, counted from the top_k_index its experts
    module is called with (the router's choice, global ids, before expert parallel's dispatch). Dropless, and no
    bias to update; a recompute (activation checkpointing) is not counted twice."""

    bias_update_rate = 0.0

    def __init__(self, experts: nn.Module, top_k: int, device: torch.device):
        self.n_experts, self.top_k = experts.num_experts, top_k
        self.tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.int64, device=device)
        self.dropped_tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.aux_loss_sum = torch.zeros((), device=device)
        self.aux_grad_scale = 1.0
        experts.register_forward_pre_hook(self._count, with_kwargs=True)

    @classmethod
    def on(cls, experts: nn.Module, top_k: int, device: torch.device) -> RoutedTokens:
        """The experts module's counter, hooked once (a model trained twice in one process keeps its first)."""
        if not isinstance(getattr(experts, "routed_tokens", None), cls):
            experts.routed_tokens = cls(experts, top_k, device)
        return experts.routed_tokens

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled() and not _recomputing():  # training forwards only, each once
            ids = (args[1] if len(args) > 1 else kwargs["top_k_index"]).flatten()
            with torch.no_grad():  # index_add_: no host sync (bincount's length would need the largest id)
                self.tokens_per_expert.index_add_(0, ids.to(self.tokens_per_expert.device), torch.ones_like(ids))


def _moes(model: nn.Module, device: torch.device) -> dict[str, MoE | RoutedTokens]:
    """{name: layer load} of the built-in MoE layers, else of a transformers MoE's fused experts (RoutedTokens)."""
    found = {name: module for name, module in model.named_modules() if isinstance(module, MoE)}
    if found:
        return found
    modules = dict(model.named_modules())
    return {name: RoutedTokens.on(experts.module, top_k_of(modules[name.rpartition(".")[0]]), device)
            for name, experts in split_experts(model).items() if experts.fused}


class ExpertLoad:
    """The MoE layers of the whole model (`names`, in its order: every rank's rows of one all-reduce) and those this
    rank holds (`held`: all of them, but a pipeline stage's). tp: how many ranks see the same tokens (a tensor-parallel
    group's: counted once); data_ranks: the ranks whose aux losses are averaged, those that read different
    micro-batches times the ranks that each hold a part of one's tokens (token_split: each rank's counted as they are);
    pieces: the microbatches a pipeline cuts each micro-batch into (1 without one)."""

    def __init__(self, whole: dict[str, MoE | RoutedTokens], held: dict[str, MoE | RoutedTokens], tp: int = 1,
                 data_ranks: int = 1,
                 pieces: int = 1, pipelined: bool = False, device: torch.device = torch.device("cpu")):
        self.names, self.held, self.device = list(whole), held, device
        self.tp, self.data_ranks, self.pieces, self.pipelined = tp, data_ranks, pieces, pipelined
        self.n_experts = max(moe.n_experts for moe in whole.values())
        self.top_k = max(moe.top_k for moe in whole.values())
        self.bias_rate = max(moe.bias_update_rate for moe in whole.values())  # the same on every rank
        self.counts: torch.Tensor | None = None  # [layers, experts] the global tokens of the last step reduced
        self.dropped: torch.Tensor | None = None  # [layers]
        self.aux: torch.Tensor | None = None  # [layers] under pipeline parallel: the aux losses' global means
        self._logged: dict[str, float] = {}

    @classmethod
    def of(cls, model: nn.Module, strategy, device: torch.device) -> ExpertLoad | None:
        """The model's expert load, None when it has no MoE layer (the placed model: a Pipelined view's whole model
        names every stage's layers). Every rank builds the same names (they share the model's structure)."""
        placed = unwrap(model)
        pipeline = getattr(placed, "pipeline", None)
        whole = _moes(pipeline.whole if pipeline is not None else placed, device)  # the other stages' on meta
        if not whole:
            return None
        dims = strategy.dims
        return cls(whole, _moes(placed, device), dims.tensor_parallel, dims.data_parallel * dims.token_split,
                   pipeline.microbatches if pipeline is not None else 1, pipeline is not None, device)

    def start(self, micro_steps: int) -> None:
        """Before a step's forwards: clears the counts (a dry batch's, an evaluation's) and sets the aux losses'
        gradient under pipeline parallel, each microbatch's share of the step, as the trainer's loss has it."""
        for moe in self.held.values():
            _clear(moe)
            moe.aux_grad_scale = 1.0 / (micro_steps * self.pieces)

    def after_step(self, log: bool) -> None:
        """After the optimizer step (every rank, same order): the one all-reduce, then the bias update; the figures
        on log steps. Without a bias to update, only log steps reduce (the counts of the others are cleared)."""
        self._logged = {}
        if not (log or self.bias_rate):
            return
        rows = self._rows()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(rows)
        rows = rows / self.tp
        self.counts, self.dropped = rows[:, :-2], rows[:, -2]
        self.aux = rows[:, -1] / self.data_ranks
        if self.bias_rate:
            self._update_bias()
        if log:
            self._logged = self._figures()

    def _rows(self) -> torch.Tensor:
        """[layers, experts + 2]: each held layer's counts, dropped tokens and scaled aux losses; zero for the rest."""
        rows = torch.zeros(len(self.names), self.n_experts + 2, dtype=torch.float64, device=self.device)
        for index, name in enumerate(self.names):
            moe = self.held.get(name)
            if moe is not None:
                rows[index, :moe.n_experts] = moe.tokens_per_expert.double()
                rows[index, -2] = moe.dropped_tokens.double()
                rows[index, -1] = moe.aux_loss_sum.double()
        return rows

    @torch.no_grad()
    def _update_bias(self) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias up by the rate when it got fewer tokens
        than the mean, down when more (the same on every rank: the global counts)."""
        for index, name in enumerate(self.names):
            moe = self.held.get(name)
            if moe is not None and moe.bias_update_rate:
                load = self.counts[index, :moe.n_experts]
                step = torch.sign(load.mean() - load) * moe.bias_update_rate
                moe.expert_bias += step.to(moe.expert_bias.dtype)

    def _figures(self) -> dict[str, float]:
        """expert_imbalance (max / mean tokens per expert, the worst layer), dropped_tokens (every layer's), and under
        pipeline parallel aux_loss (the stages' sum, which the trainer's extra losses cannot see there)."""
        counts = self.counts
        mean = counts.mean(dim=1).clamp(min=1e-12)
        figures = {"aux_loss": self.aux.sum().item()} if self.pipelined and self.aux.abs().sum() > 0 else {}
        return {**figures, "expert_imbalance": (counts.max(dim=1).values / mean).max().item(),
                "dropped_tokens": self.dropped.sum().item()}

    def describe(self, dims: ParallelDims) -> str:
        """The start-up line: the MoE layers, and how many of each one's experts a rank holds, over which ranks."""
        ep, experts = dims.expert_parallel, self.n_experts
        rest = dims.expert_shard_group()[1] if dims.fully_shard else 1  # the experts' shard group, beside ep
        layout = (f"expert parallel {ep}" + (f" x fsdp {rest}" if rest > 1 else "") if ep > 1 else
                  f"no expert parallel ({'fsdp ' + str(rest) + ' shards them' if rest > 1 else 'whole on each rank'})")
        return (f"experts: {len(self.names)} MoE layers of {experts} experts (top {self.top_k}); {layout}: "
                f"{experts // ep} of {experts} experts per rank")

    def logged(self) -> dict[str, float]:
        """The last log step's figures for the log line and metrics.jsonl ({} on other steps)."""
        return self._logged


def _clear(moe: MoE | RoutedTokens) -> None:
    moe.tokens_per_expert.zero_()
    moe.dropped_tokens.zero_()
    moe.aux_loss_sum.zero_()
