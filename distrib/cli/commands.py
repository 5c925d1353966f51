"""The commands other than distrib train: plan, doctor, lighthouse, config, plot, eval and predict (checked here,
run here or in N launched workers), generate; each takes its parsed arguments and returns an exit code."""

from __future__ import annotations

import argparse
import sys

from distrib.cli.train import check_nproc
from distrib.errors import UserError


def plan(args: argparse.Namespace) -> int:
    from distrib.config import load_config
    from distrib.distributed.strategies import check_config
    from distrib.plan import GB, GIB, Machine, main

    config = load_config(args.config, args.set)
    check_config(config)
    nproc = args.nproc_per_node or (args.world_size if args.world_size and not args.nnodes else 8)
    nnodes = args.nnodes or (args.world_size // nproc if args.world_size else 1)
    if args.world_size and nnodes * nproc != args.world_size:
        raise UserError(f"--world-size {args.world_size}: is not --nnodes {nnodes} x --nproc-per-node {nproc}; "
                        "give --world-size alone (one node), or --nnodes and --nproc-per-node")
    for name, value in (("--nnodes", nnodes), ("--nproc-per-node", nproc), ("--device-memory", args.device_memory),
                        ("--host-memory", args.host_memory),
                        ("--intra-node-bandwidth", args.intra_node_bandwidth),
                        ("--inter-node-bandwidth", args.inter_node_bandwidth)):
        if not value > 0:
            raise UserError(f"{name} {value}: must be > 0")
    machine = Machine(nnodes, nproc, args.device_memory * GIB, args.intra_node_bandwidth * GB,
                      args.inter_node_bandwidth * GB, args.host_memory * GIB, _failures(args))
    if args.dry_run:
        from distrib.plan import dry_run

        return dry_run.main(config, machine, args.json, args.every_block)
    return main(config, machine, args.json)


def _failures(args: argparse.Namespace):
    """The goodput line's keys (distrib.plan.machine.Failures), each > 0 or a one-line UserError."""
    from distrib.plan.machine import GB, Failures

    for name, value in (("--failures-per-gpu-hour", args.failures_per_gpu_hour),
                        ("--restart-seconds", args.restart_seconds), ("--storage-bandwidth", args.storage_bandwidth),
                        ("--save-seconds", args.save_seconds), ("--step-seconds", args.step_seconds)):
        if value is not None and not value > 0:
            raise UserError(f"{name} {value}: must be > 0")
    given = {"per_gpu_hour": args.failures_per_gpu_hour, "restart_seconds": args.restart_seconds,
             "storage_bandwidth": args.storage_bandwidth and args.storage_bandwidth * GB,
             "save_seconds": args.save_seconds, "step_seconds": args.step_seconds}
    return Failures(**{name: value for name, value in given.items() if value is not None})

def doctor(args: argparse.Namespace) -> int:
    from distrib.launch.doctor import main as doctor

    check_nproc(args.nproc_per_node)
    return doctor(args.nproc_per_node)


def lighthouse(args: argparse.Namespace) -> int:
    from distrib.launch.lighthouse import serve

    return serve(args.min_replicas, args.bind, args.join_timeout_ms)


def show_config(args: argparse.Namespace) -> int:
    from distrib import config_reference

    if args.toml or args.markdown:
        if args.section:
            raise UserError(f"distrib config {args.section} --{'toml' if args.toml else 'markdown'}: the file form "
                            "covers every section; leave out the section, or drop the flag to print one section")
        print(config_reference.toml() if args.toml else config_reference.markdown(), end="")
    else:
        print(config_reference.text(args.section), end="")
    return 0


def plot(args: argparse.Namespace) -> int:
    from distrib.metrics.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def use(args: argparse.Namespace) -> int:
    """distrib eval and distrib predict: checked here, then run in this process or in N launched workers."""
    from distrib.training.inference import check_input, check_rebuildable
    from distrib.training.trained import load_trained

    trained = load_trained(args.source, args.config, args.set)  # a bad run dir or checkpoint fails before any worker
    if args.command == "predict":
        check_input(args.input)
    check_rebuildable(trained, args.input if args.command == "predict" else None)  # before any data is read
    if args.nproc_per_node is not None:
        from distrib.launch.launcher import main as launch

        return launch(["--nproc-per-node", str(args.nproc_per_node), "-m", "distrib", args.command, *args.argv])
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_use_worker)(args, trained)


def _use_worker(args: argparse.Namespace, trained) -> int:
    from pathlib import Path

    from distrib.distributed.runtime import open_runtime
    from distrib.metrics.recorder import headline
    from distrib.training.inference import evaluate_trained, predict_trained

    with open_runtime(trained.config.dist) as runtime:
        if args.command == "eval":
            out = Path(args.out) if args.out else trained.out_dir / "eval.json"
            metrics = evaluate_trained(trained, runtime, out)
            if runtime.is_main:
                print(f"{trained.source}: {headline(metrics)}, loss {metrics['test_loss']:.4f} over "
                      f"{metrics['test_count']} samples at world size {runtime.world_size}; written to {out}")
        else:
            count = predict_trained(trained, runtime, args.input, Path(args.out))
            if runtime.is_main:
                print(f"{count} predictions written to {args.out}")
    return 0


def generate(args: argparse.Namespace) -> int:
    from distrib.training.generate import generate_text

    text = generate_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                         args.tokenizer)
    sys.stdout.write(text + "\n")
    return 0

