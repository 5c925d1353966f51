"""The parser of distrib's commands (all but launch, which torchrun's own parser reads): a wrong argument is one line
and exit 2, not argparse's usage text."""

from __future__ import annotations

import argparse
from typing import NoReturn

from distrib.cli import commands
from distrib.cli import train as train_command
from distrib.launch.arguments import usage_error
from distrib.launch.launcher import add_train_flags


class _Parser(argparse.ArgumentParser):
    """A wrong argument is one line and exit 2 (arguments.usage_error), not argparse's usage text; the subcommands'
    parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise usage_error(self.prog, message)



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


def _generate_parser(subparsers) -> None:
    generate = subparsers.add_parser("generate", help="continue a prompt with a text run's model (bytes), or a tokens "
                                                    "run's (with --tokenizer); the same text for the same --seed")
    generate.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of a data.name = text or tokens run")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, required=True, help="tokens (bytes) to generate")
    generate.add_argument("--tokenizer", metavar="PATH", help="a tokens run's tokenizer: a Hugging Face tokenizers "
                                                              "JSON file, or a transformers tokenizer folder")
    generate.add_argument("--temperature", type=float, default=1.0, help="divides the logits; 0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    generate.set_defaults(func=commands.generate)


def _lighthouse_parser(subparsers) -> None:
    from distrib.launch.lighthouse import DEFAULT_BIND, JOIN_TIMEOUT_MS

    lighthouse = subparsers.add_parser("lighthouse", help="torchft's Lighthouse for fault-tolerant replica groups "
                                                        "across nodes, until stopped")
    lighthouse.add_argument("--min-replicas", type=int, default=1, help="dist.min_replicas: the fewest replica groups "
                                                                        "a step may commit with (default 1)")
    lighthouse.add_argument("--bind", default=DEFAULT_BIND, metavar="HOST:PORT",
                            help=f"where to listen (default {DEFAULT_BIND}: every interface, as torchft_lighthouse)")
    lighthouse.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS,
                            help="how long a quorum waits for a live group that has not joined yet")
    lighthouse.set_defaults(func=commands.lighthouse)


def _use_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    use = subparsers.add_parser(name, help=help_text)
    use.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                     help="a run.dir holding model.pt and config.toml, or a checkpoint file (its stored config)")
    use.add_argument("--config", help="TOML file replacing the run's (or checkpoint's) config")
    use.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value (e.g. data.root, dist.device); repeatable")
    use.add_argument("--nproc-per-node", type=int, default=None,
                     help="run on this many workers on this node (or launch `-m distrib %s` with torchrun)" % name)
    use.set_defaults(func=commands.use)
    return use


def parser() -> argparse.ArgumentParser:
    """distrib's parser: one subparser per command, each naming the function that runs it (func)."""
    top = _Parser(prog="distrib", description="Data-parallel training for PyTorch.")
    subparsers = top.add_subparsers(dest="command", required=True)
    _train_parser(subparsers)
    _plan_parser(subparsers)
    # Listed for --help only: main() hands `launch` to torchrun's own parser before this one sees it.
    subparsers.add_parser("launch", help="torchrun-compatible launcher: distrib launch [torchrun options] "
                                         "SCRIPT|-m MODULE [args]; see distrib launch --help")
    doctor = subparsers.add_parser("doctor", help="print the launch environment and check it (GPUs, ports, SLURM)")
    doctor.add_argument("--nproc-per-node", type=int, default=None,
                        help="workers per node you plan to launch (default: from the environment, else GPUs)")
    doctor.set_defaults(func=commands.doctor)
    _lighthouse_parser(subparsers)
    _config_parser(subparsers)
    plot = subparsers.add_parser("plot", help="write a run's curves (loss, test accuracy, samples/s) as a PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of a run (it holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/curves.png)")
    plot.set_defaults(func=commands.plot)
    _eval_and_predict_parsers(subparsers)
    _generate_parser(subparsers)
    return top


def _train_parser(subparsers) -> None:
    train = subparsers.add_parser("train", allow_abbrev=False,  # an abbreviated launch flag would reach the workers
                                  help="train a model (one process, or N workers with --nproc-per-node)")
    train.add_argument("--config", help="TOML file; the built-in defaults train the seed Network on Fashion-MNIST")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value; repeatable")
    train.add_argument("--nproc-per-node", type=int, default=None,
                       help="launch this many workers on this node (a shorthand for distrib launch)")
    add_train_flags(train)
    train.set_defaults(func=train_command.command)


def _plan_parser(subparsers) -> None:
    plan = subparsers.add_parser("plan", help="per-rank memory, batch layout and communication of a run at any world "
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
    plan.set_defaults(func=commands.plan)


def _config_parser(subparsers) -> None:
    config = subparsers.add_parser("config", help="every config key with its type, default and meaning (one section "
                                                  "with SECTION); --toml: a complete commented config of the defaults")
    config.add_argument("section", nargs="?", metavar="SECTION", help="data, model, train, run, dist, checkpoint, "
                                                                      "speed or metrics")
    form = config.add_mutually_exclusive_group()
    form.add_argument("--toml", action="store_true", help="a config file of every key at its default, commented")
    form.add_argument("--markdown", action="store_true", help="the reference page (docs/config.md)")
    config.set_defaults(func=commands.show_config)


def _eval_and_predict_parsers(subparsers) -> None:
    evaluate = _use_parser(subparsers, "eval", "exact test metrics of a trained model, at any world size, "
                                               "written to eval.json beside it; nothing else is touched")
    evaluate.add_argument("--out", default=None,
                          help="the JSON file to write (default: eval.json in RUN_DIR, or beside the checkpoint)")
    predict = _use_parser(subparsers, "predict", "one JSON line per input sample: predicted label, class name and "
                                                 "top-k probabilities, in input order at any world size")
    predict.add_argument("--input", required=True, metavar="FOLDER|test|train",
                         help="a folder of images (sorted by path; ./test for a folder named test), or a split of "
                              "the run's data (sources split:index)")
    predict.add_argument("--out", required=True, help="the JSON Lines file to write (rank 0 writes it)")
