"""The GPU check behind scripts/gpu_check.sh: DDP equivalence at world size 1 against a plain model (NCCL on a GPU),
FSDP2 against DDP, the device-mismatch listing, the seed Network's throughput at several global batches (DDP, and
FSDP2 with the bf16 mixed-precision policy), and a byte-level GPT in bf16 under ddp, fsdp, hsdp, tensor parallel 2
and pipeline parallel 2, and fsdp with speed.compile (tokens/s, MFU, peak memory); prints one table. Under a
launcher (--gpt-only) the GPT rows run on every GPU.

    python scripts/gpu_check.py --device cuda [--json gpu_check.json]      (what gpu_check.sh runs)
    python scripts/gpu_check.py --device cpu --quick                        (a smoke test of the same code on gloo)
Installs nothing and needs only torch: a missing tqdm is replaced by a silent stand-in."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, installed or not

MODES = {  # label -> --set overrides; compile last: its warm-up is the slowest part, and the budget may end there
    "fp32": ["train.precision=fp32"],
    "bf16": ["train.precision=bf16"],
    "bf16 dataloader": ["train.precision=bf16", "data.loader=dataloader"],  # the data path's cost on this device
    "fsdp bf16": ["train.precision=bf16", "dist.strategy=fsdp"],  # FSDP2: bf16 parameters, fp32 gradient reduction
    "bf16+compile": ["train.precision=bf16", "speed.compile=true"],
}


def _stub_tqdm() -> None:
    """distrib's progress bar comes from tqdm, which a bare GPU image may lack; the check never shows a bar."""
    try:
        import tqdm  # noqa: F401 - only whether it imports
    except ImportError:
        class _Bar:
            def __init__(self, *args, **kwargs): ...
            def update(self, n=1): ...
            def close(self): ...
            @staticmethod
            def write(text, file=None):
                print(text, file=file or sys.stderr)

        sys.modules["tqdm"] = types.SimpleNamespace(tqdm=_Bar)


def check_equivalence(runtime, steps: int) -> dict:
    """DDP at world size 1 takes the same steps as the plain model, from the same seed and batches."""
    import torch
    import torch.nn.functional as F

    from distrib.distributed.parallel import place_model
    from distrib.distributed.parallelize import wrap_ddp
    from distrib.models.network import Network

    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False  # same kernels both times
    models = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = place_model(Network(), runtime.device)
        models.append((wrap_ddp(model, runtime) if wrap else model, model))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
               for _ in range(steps)]
    for trained, _ in models:
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.05, momentum=0.9)
        for inputs, targets in batches:
            loss = F.cross_entropy(trained(inputs.to(runtime.device)), targets.to(runtime.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved  # the throughput runs' defaults
    plain, ddp = (m.state_dict() for _, m in models)
    diff = max(((plain[k] - ddp[k]).abs().max() / plain[k].abs().max().clamp_min(1e-12)).item() for k in plain)
    return {"check": f"DDP ({runtime.backend}, world size 1) = plain model, {steps} steps", "ok": diff <= 1e-6,
            "detail": "bitwise equal" if diff == 0 else f"max relative difference {diff:.2e}"}


def check_fsdp(runtime, steps: int, run_dir: Path) -> dict:
    """FSDP2 (fully_shard on this backend) trains the same weights as DDP through distrib's own path, fp32."""
    import torch

    from distrib.config import load_config
    from distrib.worker import train_on

    weights = {}
    for strategy in ("ddp", "fsdp"):
        overrides = ["data.name=synthetic", "data.synthetic_train_size=2048", "data.synthetic_test_size=100",
                     "train.global_batch_size=64", "train.epochs=0", f"train.max_steps={steps}", "run.progress=false",
                     f"run.dir={run_dir / strategy}", "checkpoint.every_steps=0", "checkpoint.resume=never",
                     f"dist.device={runtime.device.type}", f"dist.strategy={strategy}"]
        with contextlib.redirect_stderr(io.StringIO()):
            train_on(load_config(None, overrides), runtime)
        weights[strategy] = torch.load(run_dir / strategy / "model.pt", weights_only=True, map_location="cpu")
    ddp, fsdp = weights["ddp"], weights["fsdp"]
    same_keys = list(ddp) == list(fsdp) and all(ddp[k].shape == fsdp[k].shape for k in ddp)
    diff = max(((ddp[k] - fsdp[k]).abs().max() / ddp[k].abs().max().clamp_min(1e-12)).item() for k in ddp)
    return {"check": f"FSDP2 ({runtime.backend}, world size {runtime.world_size}) = DDP, {steps} steps, model.pt",
            "ok": same_keys and diff <= 1e-5,
            "detail": ("same keys and shapes; " if same_keys else "keys or shapes differ; ")
            + ("bitwise equal" if diff == 0 else f"max relative difference {diff:.2e}")}


def check_mismatch(runtime) -> list[dict]:
    """A buffer that stays behind after .to(), and a tensor made in forward() on another device, must be named."""
    import torch

    from distrib.distributed.parallel import explain_device_errors, place_model
    from distrib.errors import DeviceMismatchError
    from distrib.models.network import Network

    elsewhere = "cpu" if runtime.device.type != "cpu" else "meta"

    class PinnedBuffer(Network):
        def __init__(self):
            super().__init__()
            self.register_buffer("offset", torch.zeros(10))

        def _apply(self, fn, recurse=True):
            super()._apply(fn, recurse)
            self.offset = torch.zeros(10, device=elsewhere)  # re-pinned after every .to()
            return self

    class ForwardMakesTensor(Network):
        def forward(self, t):
            return super().forward(t) + torch.zeros(10, device=elsewhere)

    messages = []
    for build in (lambda: place_model(PinnedBuffer(), runtime.device),
                  lambda: _forward_explained(ForwardMakesTensor(), runtime, explain_device_errors)):
        try:
            build()
            messages.append("no error raised")
        except DeviceMismatchError as e:
            messages.append(str(e))
    return [{"check": "device mismatch: a pinned buffer is named", "detail": messages[0][:150],
             "ok": f"buffer offset is on {elsewhere}" in messages[0] and f"expected {runtime.device}" in messages[0]},
            {"check": "device mismatch: a tensor made in forward() is explained", "detail": messages[1][:150],
             "ok": "forward() made a tensor elsewhere" in messages[1]}]


def _forward_explained(model, runtime, explain_device_errors) -> None:
    import torch

    from distrib.distributed.parallel import place_model

    model = place_model(model, runtime.device)
    inputs = torch.zeros(2, 1, 28, 28, device=runtime.device)
    with explain_device_errors(model, runtime.device, {"inputs": inputs}):
        model(inputs)


def measure(runtime, batch: int, mode: str, args, run_dir: Path) -> dict:
    """distrib's own path (worker.train_on) on synthetic data of Fashion-MNIST's shape; its summary's figures."""
    from distrib.config import load_config
    from distrib.worker import train_on

    overrides = ["data.name=synthetic", f"data.synthetic_train_size={args.train_size}", "data.synthetic_test_size=1000",
                 f"train.global_batch_size={batch}", "train.epochs=0", f"train.max_steps={args.steps}",
                 "train.eval_every_epochs=0", f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}",
                 "run.progress=false", f"run.dir={run_dir}", "checkpoint.every_steps=0", "checkpoint.resume=never",
                 f"dist.device={args.device}", *MODES[mode]]
    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log):  # the trainer's log lines would bury the table
            summary = train_on(load_config(None, overrides), runtime)
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise
    keys = ("samples_per_second", "step_time_p50_s", "data_wait_share", "mfu")
    return {"batch": batch, "mode": mode, **{k: summary[k] for k in keys}}


GPT_MODES = {"gpt bf16": ["train.precision=bf16"], "gpt fsdp bf16": ["train.precision=bf16", "dist.strategy=fsdp"],
             # hsdp: a 1 x N mesh on one node (shard groups of the node's N GPUs, one replica)
             "gpt hsdp bf16": ["train.precision=bf16", "dist.strategy=hsdp"],
             # tensor parallel 2 (the GPT's 6 heads and 1024 hidden units divide by 2) x fsdp over the rest
             "gpt tp2 bf16": ["train.precision=bf16", "dist.strategy=fsdp", "dist.tensor_parallel=2"],
             # pipeline parallel 2 (1f1b, 2 microbatches) x fsdp over the rest; untied: a stage holds the embedding,
             # another the output layer
             "gpt pp2 bf16": ["train.precision=bf16", "dist.strategy=fsdp", "dist.pipeline_parallel=2"],
             # each Block compiled in place before fully_shard (distrib.distributed.compile); last: the slowest warm-up
             "gpt fsdp bf16+compile": ["train.precision=bf16", "dist.strategy=fsdp", "speed.compile=true"]}
UNTIED = ("gpt pp2 bf16",)
GPT_SIZE = {"n_layers": 6, "n_heads": 6, "dim": 384}  # nanoGPT's Shakespeare-char model, context 256
GPT_QUICK = {"n_layers": 2, "n_heads": 2, "dim": 32}


def measure_gpt(runtime, mode: str, args, run_dir: Path) -> dict:
    """The built-in GPT on the docs' bytes (README.md and docs/*.md) through worker.train_on: tokens/s, MFU (6 x
    parameters + attention per token), and the peak device memory."""
    from bench_gpt import docs_text  # scripts/, on the path as this file's folder

    from distrib.config import load_config
    from distrib.worker import train_on

    parallel = next((f"{kind} parallel 2" for kind in ("tensor", "pipeline") if f"dist.{kind}_parallel=2" in
                     GPT_MODES[mode]), None)
    if parallel and runtime.world_size % 2:
        return {"mode": mode, "skipped": f"{parallel} needs an even world size, not {runtime.world_size}: "
                                         "gpu_check.sh runs it under distrib launch on 2+ GPUs"}
    size = {**(GPT_QUICK if args.quick else GPT_SIZE), **({"tie_weights": "false"} if mode in UNTIED else {})}
    kwargs = ", ".join(f"{key} = {value}" for key, value in size.items())
    overrides = ["data.name=text", f"data.root={docs_text()}",
                 f"data.seq_len={args.gpt_seq_len}", "model.name=gpt", f"model.kwargs={{{kwargs}}}",
                 "train.optimizer=adamw", "train.lr=1e-3", f"train.global_batch_size={args.gpt_batch}",
                 "train.epochs=0", f"train.max_steps={args.steps}", "train.eval_every_epochs=0",
                 f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}", "run.progress=false",
                 f"run.dir={run_dir}", "checkpoint.every_steps=0", "checkpoint.resume=never",
                 f"dist.device={args.device}", *GPT_MODES[mode]]
    with contextlib.redirect_stderr(io.StringIO()):
        summary = train_on(load_config(None, overrides), runtime)
    keys = ("tokens_per_second", "step_time_p50_s", "mfu", "peak_memory_bytes", "test_loss")
    return {"mode": mode, "world_size": runtime.world_size, "batch": args.gpt_batch, "seq_len": args.gpt_seq_len,
            **{k: summary.get(k) for k in keys}}


@contextlib.contextmanager
def shared_folder(runtime):
    """A temporary folder that every rank uses (rank 0's, as a run.dir is one folder for all ranks), removed after."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as mine:
        name = [mine]
        if runtime.world_size > 1:
            dist.broadcast_object_list(name, src=0)
        yield name[0]
        if runtime.world_size > 1:
            dist.barrier()  # nobody still writes into rank 0's folder when it is removed


def run_all(args) -> tuple[list[dict], list[dict]]:
    from distrib.config import DistConfig
    from distrib.distributed.runtime import open_runtime

    checks, rows = [], []
    deadline = time.monotonic() + args.budget_s
    with open_runtime(DistConfig(device=args.device, timeout_s=600)) as runtime, shared_folder(runtime) as tmp:
        args.device_name, args.is_main = runtime.device_name(), runtime.is_main
        if not args.gpt_only:
            checks += [check_equivalence(runtime, args.equivalence_steps), *check_mismatch(runtime),
                       check_fsdp(runtime, args.equivalence_steps, Path(tmp) / "fsdp_check")]
        for mode in args.gpt_modes:  # first: the figures no GPU has given yet
            if time.monotonic() > deadline:
                args.gpt_rows.append({"mode": mode, "skipped": "time budget"})
                continue
            args.gpt_rows.append(measure_gpt(runtime, mode, args, Path(tmp) / mode.replace(" ", "_")))
        for mode in [] if args.gpt_only else args.modes:
            for batch in args.batches:
                if time.monotonic() > deadline:  # stay inside the time the job was given; say what was left out
                    rows.append({"batch": batch, "mode": mode, "skipped": "time budget"})
                    continue
                rows.append(measure(runtime, batch, mode, args, Path(tmp) / f"{mode}-{batch}".replace(" ", "_")))
    return checks, rows


def table(args, checks: list[dict], rows: list[dict]) -> str:
    import torch

    lines = [f"{args.device_name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}", ""]
    if args.gpt_only:
        return "\n".join(lines + _gpt_table(args.gpt_rows))
    lines += [f"{'check':<58} {'result':<6} detail"]
    lines += [f"{c['check']:<58} {'PASS' if c['ok'] else 'FAIL':<6} {c['detail']}" for c in checks]
    lines += ["", f"{'global batch':>12}  {'mode':<16} {'samples/s':>12} {'p50 step ms':>11} {'data wait':>9} "
                  f"{'MFU':>7}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['batch']:>12}  {r['mode']:<16} skipped ({r['skipped']})")
            continue
        mfu = f"{100 * r['mfu']:.2f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"{r['batch']:>12}  {r['mode']:<16} {r['samples_per_second']:>12,.0f} "
                     f"{1e3 * r['step_time_p50_s']:>11.2f} {100 * r['data_wait_share']:>8.1f}% {mfu:>7}")
    return "\n".join(lines + _gpt_table(args.gpt_rows))


def _gpt_table(rows: list[dict]) -> list[str]:
    lines = ["", f"{'GPT':<16} {'ranks':>5} {'batch x seq':>11} {'tokens/s':>12} {'p50 step ms':>11} {'MFU':>7} "
                 f"{'peak MiB':>9} {'test loss':>9}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['mode']:<16} skipped ({r['skipped']})")
            continue
        mfu = f"{100 * r['mfu']:.2f}%" if r["mfu"] is not None else "n/a"
        peak = f"{r['peak_memory_bytes'] / 2**20:,.0f}" if r["peak_memory_bytes"] else "n/a"
        lines.append(f"{r['mode']:<16} {r['world_size']:>5} {r['batch']:>5} x {r['seq_len']:<4} "
                     f"{r['tokens_per_second']:>12,.0f} "
                     f"{1e3 * r['step_time_p50_s']:>11.2f} {mfu:>7} {peak:>9} {r['test_loss']:>9.4f}")
    return lines


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no compile: a smoke test of this script")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per throughput run")
    parser.add_argument("--skip", type=int, default=30, help="first steps left out of the figures (compile)")
    parser.add_argument("--equivalence-steps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=240, help="throughput runs stop starting after this")
    parser.add_argument("--json", default=None, help="also write the checks and rows here")
    parser.add_argument("--gpt-only", action="store_true",
                        help="only the GPT under every strategy (gpu_check.sh runs it under distrib launch on N GPUs)")
    args = parser.parse_args(argv)
    args.batches, args.modes, args.gpt_modes = (512, 1024, 4096), list(MODES), list(GPT_MODES)
    args.gpt_batch, args.gpt_seq_len, args.gpt_rows, args.train_size = 64, 256, [], 60000
    if args.quick:  # a smoke test: making 60,000 synthetic images per row was most of its time
        args.train_size = 2048
        args.batches, args.modes = (32,), ["fp32", "bf16", "bf16 dataloader", "fsdp bf16"]
        args.steps, args.skip, args.equivalence_steps = 4, 1, 3
        args.gpt_batch, args.gpt_seq_len = 4, 16
        args.gpt_modes = [mode for mode in GPT_MODES if "speed.compile=true" not in GPT_MODES[mode]]
    return args


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _stub_tqdm()
    code = 1
    try:
        checks, rows = run_all(args)
        if args.is_main:  # under a launcher every rank measured; rank 0 prints
            print(table(args, checks, rows))
        if args.json and args.is_main:
            result = {"device": args.device_name, "checks": checks, "rows": rows, "gpt": args.gpt_rows}
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        code = 0 if all(c["ok"] for c in checks) else 1
    except Exception as e:  # noqa: BLE001 - one line, then the hard exit
        print(f"gpu_check: {type(e).__name__}: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the process group is closed (barrier, destroy); skip teardown, where gloo/NCCL can abort


if __name__ == "__main__":
    main()
