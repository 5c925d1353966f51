"""argv in, exit code out: the only place that turns user errors into one-line messages.

    distrib train [--config FILE] [--set section.key=value ...] [--nproc-per-node N] [--max-restarts K] [--nnodes ...]
    distrib launch [torchrun options] SCRIPT|-m MODULE [args ...]
    distrib plan [--config FILE] [--set ...] (--nnodes N --nproc-per-node N | --world-size N) [--json] [--dry-run]
    distrib doctor
    distrib lighthouse [--min-replicas M] [--bind HOST:PORT] [--join-timeout-ms MS]
    distrib config [SECTION] [--toml | --markdown]
    distrib plot RUN_DIR [--out FILE]
    distrib eval RUN_DIR|CHECKPOINT [--config FILE] [--set ...] [--nproc-per-node N] [--out FILE]
    distrib predict RUN_DIR|CHECKPOINT --input FOLDER|test|train --out FILE [--config FILE] [--set ...] [...]
    distrib generate RUN_DIR --prompt TEXT --max-new-tokens N [--tokenizer PATH] [--temperature T --top-k K --seed S]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from distrib.errors import EXIT_PREEMPTED, UserError, hard_exit, say
from distrib.launch.arguments import usage_error
from distrib.launch.clusters import check_pod, wants_launcher
from distrib.launch.launcher import add_train_flags, launch_trainer, train_flags, without_train_flags
from distrib.launch.reporting import told_elsewhere

EXIT_USER_ERROR = 2


def _train(args: argparse.Namespace) -> int:
    from distrib.config import load_config
    from distrib.distributed import dimensions
    from distrib.distributed.runtime import read_launch_env
    from distrib.distributed.strategies import check_config
    from distrib.launch.rundir import check_folders
    from distrib.metrics import require_loggers

    config = load_config(args.config, args.set)  # fail on a bad config before starting any worker
    config = dimensions.worker_config(config, read_launch_env())  # a degree's own folders (a replica group's)
    check_config(config)  # and on a rule of its strategy (imports torch, as the launcher does anyway)
    _check_nproc(args.nproc_per_node)
    check_folders(config, probe_locks=True)  # writable and not another live run's (rank 0 then locks them)
    require_loggers(config.metrics)  # a missing tracker package: one line here, not one per worker
    launch_flags = train_flags(args)  # --nproc-per-node, --max-restarts, --nnodes, --rdzv-*: as for distrib launch
    launch_flags += dimensions.launch_flags(config, os.environ)  # the degrees' own (a Lighthouse and its groups)
    if launch_flags or wants_launcher(os.environ):  # PET_* (a Kubeflow TrainJob) or SkyPilot: as distrib launch
        return launch_trainer(launch_flags, args.argv, _before_workers(config))
    check_pod(os.environ)
    from distrib.launch.preempt import exit_on_signals, parse_signals
    from distrib.launch.reporting import errors_reported

    # A stop request outside the training steps (importing torch, waiting for the other ranks, after the final
    # checkpoint) ends this worker with EXIT_PREEMPTED at once: nothing is lost. The training steps take the
    # signals over (checkpoint at the next step boundary, then EXIT_PREEMPTED).
    # distrib launch says how its workers were stopped, and why: its workers stay quiet.
    with exit_on_signals(parse_signals(config.checkpoint.signals), announce=lambda: not errors_reported()):
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_worker)(config)  # under a launcher, a failing rank's exception reaches its summary


def _before_workers(config):
    """What the launcher checks once, before any worker starts: the device each worker would get (CUDA present,
    enough GPUs), the layout at this world size (every parallel degree; the heads under tensor parallel) and the
    global batch's split over its data-parallel ranks."""
    def check(nproc_per_node: int, world_size: int | None) -> None:
        from distrib.config import check_world_size
        from distrib.distributed.runtime import select_device
        from distrib.plan.layout import check_layout

        select_device(config.dist.device, nproc_per_node - 1)  # the last local rank's device: all of them exist
        if world_size is not None:
            dims = check_layout(config, world_size, nproc_per_node)
            check_world_size(config.train.global_batch_size, config.train.grad_accum_steps, dims.batch_ranks)
    return check


def _check_nproc(nproc_per_node: int | None) -> None:
    if nproc_per_node is not None and nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node}: must be at least 1 (workers on this node); "
                        "e.g. --nproc-per-node 2, or leave it out to run one process")


def _worker(config) -> int:
    from distrib.launch.preempt import Preempted
    from distrib.worker import run_training

    try:
        run_training(config)
    except Preempted as e:  # a SystemExit(75): entry() ends the process with it, as distrib.fit's scripts end
        if e.announce:  # rank 0's: one line for the run, not one per rank
            say(e.line())
        return EXIT_PREEMPTED
    return 0


def _plan(args: argparse.Namespace) -> int:
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
    """The goodput line's keys (distrib.plan.goodput.Failures), each > 0 or a one-line UserError."""
    from distrib.plan.goodput import GB, Failures

    for name, value in (("--failures-per-gpu-hour", args.failures_per_gpu_hour),
                        ("--restart-seconds", args.restart_seconds), ("--storage-bandwidth", args.storage_bandwidth),
                        ("--save-seconds", args.save_seconds), ("--step-seconds", args.step_seconds)):
        if value is not None and not value > 0:
            raise UserError(f"{name} {value}: must be > 0")
    given = {"per_gpu_hour": args.failures_per_gpu_hour, "restart_seconds": args.restart_seconds,
             "storage_bandwidth": args.storage_bandwidth and args.storage_bandwidth * GB,
             "save_seconds": args.save_seconds, "step_seconds": args.step_seconds}
    return Failures(**{name: value for name, value in given.items() if value is not None})


def _goodput_flags(plan: argparse.ArgumentParser) -> None:
    """The goodput line's keys (docs/parallelism.md, Goodput); their defaults are distrib.plan.goodput's."""
    plan.add_argument("--failures-per-gpu-hour", type=float, default=None,
                      help="failures per GPU and hour (default Llama 3's: 419 in 54 days on 16,384 GPUs, 1.97e-5)")
    plan.add_argument("--restart-seconds", type=float, default=None,
                      help="from a failure to training again, the checkpoint's load included (default 300)")
    plan.add_argument("--storage-bandwidth", type=float, default=None,
                      help="GB/s each node writes to checkpoint storage (default 1: Llama 3's 2 TB/s over 2,048 nodes)")
    plan.add_argument("--save-seconds", type=float, default=None,
                      help="a checkpoint save's measured hold on training (a run's save_blocked_s; default: estimated)")
    plan.add_argument("--step-seconds", type=float, default=None,
                      help="a measured step time (default: the plan's communication bound)")


def _doctor(args: argparse.Namespace) -> int:
    from distrib.launch.doctor import main as doctor

    _check_nproc(args.nproc_per_node)
    return doctor(args.nproc_per_node)


def _lighthouse(args: argparse.Namespace) -> int:
    from distrib.launch.lighthouse import serve

    return serve(args.min_replicas, args.bind, args.join_timeout_ms)


def _config(args: argparse.Namespace) -> int:
    from distrib import config_reference

    if args.toml or args.markdown:
        if args.section:
            raise UserError(f"distrib config {args.section} --{'toml' if args.toml else 'markdown'}: the file form "
                            "covers every section; leave out the section, or drop the flag to print one section")
        print(config_reference.toml() if args.toml else config_reference.markdown(), end="")
    else:
        print(config_reference.text(args.section), end="")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from distrib.metrics.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _use(args: argparse.Namespace) -> int:
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


def _generate(args: argparse.Namespace) -> int:
    from distrib.training.generate import generate_text

    text = generate_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                         args.tokenizer)
    sys.stdout.write(text + "\n")
    return 0


def _generate_parser(commands) -> None:
    generate = commands.add_parser("generate", help="continue a prompt with a text run's model (bytes), or a tokens "
                                                    "run's (with --tokenizer); the same text for the same --seed")
    generate.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of a data.name = text or tokens run")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, required=True, help="tokens (bytes) to generate")
    generate.add_argument("--tokenizer", metavar="PATH", help="a tokens run's tokenizer: a Hugging Face tokenizers "
                                                              "JSON file, or a transformers tokenizer folder")
    generate.add_argument("--temperature", type=float, default=1.0, help="divides the logits; 0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    generate.set_defaults(func=_generate)


def _lighthouse_parser(commands) -> None:
    from distrib.launch.lighthouse import DEFAULT_BIND, JOIN_TIMEOUT_MS

    lighthouse = commands.add_parser("lighthouse", help="torchft's Lighthouse for fault-tolerant replica groups "
                                                        "across nodes, until stopped")
    lighthouse.add_argument("--min-replicas", type=int, default=1, help="dist.min_replicas: the fewest replica groups "
                                                                        "a step may commit with (default 1)")
    lighthouse.add_argument("--bind", default=DEFAULT_BIND, metavar="HOST:PORT",
                            help=f"where to listen (default {DEFAULT_BIND}: every interface, as torchft_lighthouse)")
    lighthouse.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS,
                            help="how long a quorum waits for a live group that has not joined yet")
    lighthouse.set_defaults(func=_lighthouse)


def _use_parser(commands, name: str, help_text: str) -> argparse.ArgumentParser:
    use = commands.add_parser(name, help=help_text)
    use.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                     help="a run.dir holding model.pt and config.toml, or a checkpoint file (its stored config)")
    use.add_argument("--config", help="TOML file replacing the run's (or checkpoint's) config")
    use.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value (e.g. data.root, dist.device); repeatable")
    use.add_argument("--nproc-per-node", type=int, default=None,
                     help="run on this many workers on this node (or launch `-m distrib %s` with torchrun)" % name)
    use.set_defaults(func=_use)
    return use


class _Parser(argparse.ArgumentParser):
    """A wrong argument is one line and exit 2 (arguments.usage_error), not argparse's usage text; the subcommands'
    parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise usage_error(self.prog, message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distrib", description="Data-parallel training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", allow_abbrev=False,  # an abbreviated launch flag would reach the workers
                                help="train a model (one process, or N workers with --nproc-per-node)")
    train.add_argument("--config", help="TOML file; the built-in defaults train the seed Network on Fashion-MNIST")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value; repeatable")
    train.add_argument("--nproc-per-node", type=int, default=None,
                       help="launch this many workers on this node (a shorthand for distrib launch)")
    add_train_flags(train)
    train.set_defaults(func=_train)
    plan = commands.add_parser("plan", help="per-rank memory, batch layout and communication of a run at any world "
                                            "size, from the real sharding plan on a fake process group; no training")
    plan.add_argument("--config", help="the TOML file distrib train would take")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one config value, as for distrib train; repeatable")
    plan.add_argument("--nnodes", type=int, default=None, help="nodes of the planned run (default 1)")
    plan.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (default 8, or --world-size)")
    plan.add_argument("--world-size", type=int, default=None, help="all ranks: one node of them unless --nnodes")
    plan.add_argument("--device-memory", type=float, default=80.0, help="GiB per device (H100: 80, H200: 141)")
    plan.add_argument("--host-memory", type=float, default=2048.0, help="GiB of host memory per node (DGX H100: 2048)")
    plan.add_argument("--intra-node-bandwidth", type=float, default=450.0,
                      help="GB/s per rank and direction within a node (NVLink 4: 450)")
    plan.add_argument("--inter-node-bandwidth", type=float, default=50.0,
                      help="GB/s per rank and direction between nodes (one 400 Gb/s NIC per GPU: 50)")
    _goodput_flags(plan)
    plan.add_argument("--json", action="store_true", help="print the figures as JSON, under summary.json's names")
    plan.add_argument("--dry-run", action="store_true", help="also build one rank's real layout on a fake process "
                                                            "group and measure a step on fake tensors (dry_run_*)")
    plan.add_argument("--every-block", action="store_true", help="with --dry-run: step every block (default: a rank "
                      "holding more than 3 alike blocks is stepped with 2 and 3 and counted for the rest)")
    plan.set_defaults(func=_plan)
    # Listed for --help only: main() hands `launch` to torchrun's own parser before this one sees it.
    commands.add_parser("launch", help="torchrun-compatible launcher: distrib launch [torchrun options] "
                                       "SCRIPT|-m MODULE [args]; see distrib launch --help")
    doctor = commands.add_parser("doctor", help="print the launch environment and check it (GPUs, ports, SLURM)")
    doctor.add_argument("--nproc-per-node", type=int, default=None,
                        help="workers per node you plan to launch (default: from the environment, else GPUs)")
    doctor.set_defaults(func=_doctor)
    _lighthouse_parser(commands)
    config = commands.add_parser("config", help="every config key with its type, default and meaning (one section "
                                                "with SECTION); --toml: a complete commented config of the defaults")
    config.add_argument("section", nargs="?", metavar="SECTION", help="data, model, train, run, dist, checkpoint, "
                                                                      "speed or metrics")
    form = config.add_mutually_exclusive_group()
    form.add_argument("--toml", action="store_true", help="a config file of every key at its default, commented")
    form.add_argument("--markdown", action="store_true", help="the reference page (docs/config.md)")
    config.set_defaults(func=_config)
    plot = commands.add_parser("plot", help="write a run's curves (loss, test accuracy, samples/s) as a PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of a run (it holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/curves.png)")
    plot.set_defaults(func=_plot)
    evaluate = _use_parser(commands, "eval", "exact test metrics of a trained model, at any world size, "
                                             "written to eval.json beside it; nothing else is touched")
    evaluate.add_argument("--out", default=None,
                          help="the JSON file to write (default: eval.json in RUN_DIR, or beside the checkpoint)")
    predict = _use_parser(commands, "predict", "one JSON line per input sample: predicted label, class name and "
                                               "top-k probabilities, in input order at any world size")
    predict.add_argument("--input", required=True, metavar="FOLDER|test|train",
                         help="a folder of images (sorted by path; ./test for a folder named test), or a split of "
                              "the run's data (sources split:index)")
    predict.add_argument("--out", required=True, help="the JSON Lines file to write (rank 0 writes it)")
    _generate_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["launch"]:  # passed through untouched, so every torchrun flag means what it means there
            from distrib.launch.launcher import main as launch

            return launch(argv[1:])
        args = _parser().parse_args(argv)
        args.argv = without_train_flags(argv[1:])  # what a launched worker runs after `distrib train` (eval, ...)
        return args.func(args)
    except UserError as e:
        if not told_elsewhere(e):
            say(f"distrib: error: {e}")
        return getattr(e, "exit_code", EXIT_USER_ERROR)  # 2; EnvironmentFault: EXIT_ENVIRONMENT (74)


def entry() -> None:
    """The console script and `python -m distrib`."""
    try:
        code = main()
    except SystemExit as e:  # argparse's own errors and --help
        code = e.code if isinstance(e.code, int) else 1
    hard_exit(code)
