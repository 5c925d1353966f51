"""Throughput of a run: per-step wall-clock marks, data-wait share, FLOPs per sample and MFU against a peak table.

Taking a mark never syncs with the device; the marks are exact wherever the step already synced (log steps)."""

from __future__ import annotations

import copy
import math
import time
from array import array
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrib.config import Config
from distrib.data import samples
from distrib.distributed.runtime import Runtime
from distrib.training.losses import forward

# Dense peak FLOP/s of one device (no sparsity), from the vendors' data sheets, by a substring of its name; the first
# match wins (so "H100 PCIe" before "H100"; "GH200" is an H200). "fp32" is the plain (non-tensor-core) rate: with
# TF32 convolutions, PyTorch's cuDNN default, fp32 MFU reads high. Override any of these with metrics.peak_flops.
PEAK_FLOPS = (
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 66.9e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 66.9e12}),
    ("H800", {"bf16": 989e12, "fp16": 989e12, "fp32": 66.9e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
)
# A nominal CPU core (AVX-512, two FMA units, ~3 GHz): a rough figure; set metrics.peak_flops for a real one.
CPU_PEAK_FLOPS_PER_THREAD = 1e11


def peak_flops(device_type: str, device_name: str, precision: str, override: float = 0.0) -> float | None:
    """Peak FLOP/s of one device for this precision; None when neither the config nor the table knows it."""
    if override:
        return override
    if device_type == "cpu":
        return CPU_PEAK_FLOPS_PER_THREAD * torch.get_num_threads()
    for key, peaks in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peaks[precision]
    return None


def tokens_per_sample(inputs) -> int | None:
    """T for integer sequence inputs [B, T] (token ids, or packed documents' input_ids), else None: what
    tokens_per_second counts."""
    if isinstance(inputs, dict) and "position_ids" in inputs:  # distrib.data.documents: windows, no padding
        inputs = inputs["input_ids"]
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and not inputs.is_floating_point() \
            and inputs.dtype != torch.bool:
        return inputs.shape[1]
    return None


def flops_per_sample(model: nn.Module, inputs, targets, loss=None) -> float | None:
    """FLOPs of one sample of the whole model (whole_on_meta's, not a shard or a stage of it): a model that counts
    its own per token (the built-in GPT: the decoder-transformer count torchtitan and PaLM use, within 4% of the
    counter's, which adds the scores a fused attention's backward recomputes: tests/unit/test_flops.py) times the
    tokens of a sample; the FLOP counter's measurement for any other model."""
    per_token = getattr(model, "flops_per_token", None)
    tokens = tokens_per_sample(inputs)
    if callable(per_token) and tokens:
        return float(per_token(tokens)) * tokens
    return count_flops_per_sample(model, inputs, targets, loss)


def whole_on_meta(factory: Callable[[], nn.Module], given: nn.Module | None = None) -> nn.Module | None:
    """The whole model on the meta device (no memory), what the FLOP count runs, the same under every strategy: built
    by the factory, or copied from a module given to distrib.fit (call this before a strategy shards it in place).
    None when the factory cannot build on meta (it reads weights itself: only ddp runs that, and holds the model
    whole). The factory's RNG draws, if any, are undone."""
    with torch.random.fork_rng(devices=[]):
        try:
            if given is not None:
                return _copy_with(given, _on_meta)
            with torch.device("meta"):
                return factory()
        except Exception:  # noqa: BLE001 - the user's factory: the strategy's own build says what is wrong with it
            return None


def _copy_with(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of the module with each parameter and buffer replaced by make(tensor) (a tied one made once)."""
    memo = {id(tensor): make(tensor) for tensor in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    meta = tensor.detach().to("meta")
    return nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def _one_value(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A zero of the tensor's shape and dtype held in one element (expanded): a matmul materialises it for its own
    time only. A trainable one drops each gradient as it is made (for another one-element tensor)."""
    value = torch.zeros((), dtype=tensor.dtype, device=device).expand(tensor.shape)
    if not isinstance(tensor, nn.Parameter):
        return value
    param = nn.Parameter(value, requires_grad=tensor.requires_grad)
    if param.requires_grad:
        param.register_hook(lambda grad: torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape))
    return param


def _cpu_attention() -> dict:
    """The CPU's fused attention, forward and backward, counted as the GPUs' is (torch's table lacks it)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    def backward_flops(grad, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad, query, key, value)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward_flops}


def count_flops_per_sample(model: nn.Module, inputs, targets, loss=None) -> float | None:
    """Forward and backward FLOPs of one training sample, by torch's FlopCounterMode, counted once on a copy of the
    model (which may be on the meta device) whose weights hold one zero each, run on the real micro-batch. Counted
    by shape, and what reads values runs (an MoE's routing sends each token to its top-k experts whatever the
    weights; a Hugging Face model checks its attention mask, which a meta tensor cannot): the copy holds nothing
    but the activations and, for one op at a time, a weight its matmul makes whole. Gradients of the trainable
    parameters only: a frozen weight counts no weight-gradient matmul. Side-effect free: eval mode (no dropout, no
    batch-norm statistics), the RNG states kept, the model untouched (no .grad write, no DDP or FSDP hook); None
    when the counter cannot run this model."""
    from torch.utils.flop_counter import FlopCounterMode

    device = next(iter(samples.named(inputs, "inputs").values())).device
    try:
        copied = _copy_with(model, lambda tensor: _one_value(tensor, device))
        copied.eval()
        params = [p for p in copied.parameters() if p.requires_grad]
        rng = torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type)
        counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention())
        # eager (compiled blocks too): the counter sees every op, and no graph is compiled for eval mode with grad
        with rng, torch.compiler.set_stance("force_eager"), counter:
            outputs = forward(copied, inputs)
            value = loss(outputs, targets) if loss is not None else F.cross_entropy(outputs.float(), targets)
            if params and value.requires_grad:
                torch.autograd.grad(value, params, allow_unused=True)
        total = counter.get_total_flops()
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError):  # an op the counter cannot run
        return None  # no MFU; the run still trains
    return total / samples.num_samples(targets, inputs) if total else None


def _quantile(sorted_values, q: float) -> float:
    """Nearest-rank quantile of an already sorted sequence."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


class Throughput:
    """Wall-clock marks of each optimizer step: when its data was ready and when it ended. A step's time runs from
    the end of the previous step (so data loading, logging and any wait are in it) and excludes evaluation."""

    def __init__(self, global_batch_size: int, world_size: int, skip_steps: int = 5):
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.skip_steps = skip_steps  # compile, allocator and DDP bucket warm-up stay out of the figures
        self.flops_per_sample: float | None = None
        self.tokens_per_sample: int | None = None  # token-sequence inputs: tokens/s = samples/s x this
        self.peak_flops_per_device: float | None = None
        self.step_seconds = array("d")
        self.wait_seconds = array("d")
        self.step_shares = array("d")  # the share of the global batch (and of the devices) that took part
        self._last = self._ready = None
        self._window_from = 0

    def restart_clock(self) -> None:
        """The next step starts now: call before the first step and after evaluations or checkpoints."""
        self._last = time.perf_counter()

    def data_ready(self) -> None:
        self._ready = time.perf_counter()

    def step_done(self, share: float = 1.0) -> None:
        """The step ended; `share`: the part of its global batch and of world_size that took part (fault-tolerant
        replica groups: the groups in its quorum over all of them)."""
        now = time.perf_counter()
        if self._last is None:  # no restart_clock() yet: count from the data
            self._last = self._ready if self._ready is not None else now
        ready = self._ready if self._ready is not None else self._last
        self.step_seconds.append(now - self._last)
        self.wait_seconds.append(max(0.0, ready - self._last))
        self.step_shares.append(share)
        self._last, self._ready = now, None

    def _stats(self, lo: int) -> dict:
        steps, waits, shares = self.step_seconds[lo:], self.wait_seconds[lo:], self.step_shares[lo:]
        total = sum(steps)
        if not steps or total <= 0:
            return dict.fromkeys(("samples_per_second", "samples_per_second_per_device", "step_time_p50_s",
                                  "step_time_p95_s", "data_wait_share", "mfu", *self._token_keys()))
        ordered = sorted(steps)
        per_second = sum(shares) * self.global_batch_size / total
        per_device = per_second / (self.world_size * sum(shares) / len(shares))
        mfu = None
        if self.flops_per_sample and self.peak_flops_per_device:
            mfu = self.flops_per_sample * per_device / self.peak_flops_per_device
        tokens = dict(zip(self._token_keys(), (per_second * (self.tokens_per_sample or 0),
                                                per_device * (self.tokens_per_sample or 0))))
        return {"samples_per_second": per_second, "samples_per_second_per_device": per_device, **tokens,
                "step_time_p50_s": _quantile(ordered, 0.50), "step_time_p95_s": _quantile(ordered, 0.95),
                "data_wait_share": sum(waits) / total, "mfu": mfu}

    def _token_keys(self) -> tuple[str, ...]:
        return ("tokens_per_second", "tokens_per_second_per_device") if self.tokens_per_sample else ()

    def window(self) -> dict:
        """Figures of the steps since the previous window(): what a log line shows."""
        stats = self._stats(self._window_from)
        self._window_from = len(self.step_seconds)
        return stats

    def summary(self) -> dict:
        """Figures of the whole run after the first skip_steps (all steps if the run is too short to skip them)."""
        skip = min(self.skip_steps, len(self.step_seconds) // 2)
        return {**self._stats(skip), "timed_steps": len(self.step_seconds) - skip,
                "flops_per_sample": self.flops_per_sample, "peak_flops_per_device": self.peak_flops_per_device}


def meter_for(config: Config, runtime: Runtime) -> Throughput:
    """The run's meter, with the peak FLOP/s of this worker's device (None, so no MFU, when unknown)."""
    # Fault-tolerant replica groups: each group's meter counts the whole job's samples over all its devices.
    devices = runtime.world_size * config.dist.fault_tolerant_groups
    meter = Throughput(config.train.global_batch_size, devices, config.metrics.timing_skip_steps)
    meter.peak_flops_per_device = peak_flops(runtime.device.type, runtime.device_name(), config.train.precision,
                                             config.metrics.peak_flops)
    return meter
