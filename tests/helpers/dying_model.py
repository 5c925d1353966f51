"""Model factories whose worker kills itself mid-run, at an exact step
(`model.factory = tests.helpers.dying_model:network`, or `:gpt` for the built-in GPT).

DISTRIB_TEST_DIE_AT=N: the worker with RANK=DISTRIB_TEST_DIE_RANK (default 1) sends itself DISTRIB_TEST_DIE_SIGNAL
(default SIGKILL) in its Nth training forward, i.e. inside optimizer step N with one micro-step: a signal at an exact
step, however fast or slow the machine. DISTRIB_TEST_DIE_ONCE=PATH: only if PATH does not exist yet (it is created
first), so a restarted worker lives. DISTRIB_TEST_DIE_GROUP=G: only in fault-tolerant replica group G (whose ranks
repeat those of the others); DISTRIB_TEST_REVIVE_WHEN=PATH: that group's restarted workers wait for PATH before they
build the model (so that the other groups go on without it for as long as a test needs), then touch PATH.RANK.
DISTRIB_TEST_DIE_IN=allreduce: the signal comes as soon as the worker has issued its Nth gradient all-reduce across
the replica groups (torchft's Manager.allreduce), with its peers inside that all-reduce, not in a forward.
Unset: the plain model."""

import os
import signal
import time
from pathlib import Path

from distrib.models.gpt import GPT
from distrib.models.network import Network


class _DiesAt:
    """Kills its own process in the die_at-th training forward."""

    die_at, signum, num_forwards = 0, signal.SIGKILL, 0

    def forward(self, *inputs, **named):  # named: a packed batch's input_ids and position_ids (the GPT's)
        if self.training:
            self.num_forwards += 1
            if self.num_forwards == self.die_at and first_death():
                os.kill(os.getpid(), self.signum)
        return super().forward(*inputs, **named)


def first_death() -> bool:
    marker = os.environ.get("DISTRIB_TEST_DIE_ONCE")
    if not marker:
        return True
    if Path(marker).exists():
        return False
    Path(marker).touch()
    return True


class _DyingNetwork(_DiesAt, Network):
    pass


class _DyingGPT(_DiesAt, GPT):
    pass


def _in_dying_group() -> bool:
    group = os.environ.get("DISTRIB_REPLICA_GROUP", "0")
    return os.environ.get("DISTRIB_TEST_DIE_GROUP", group) == group


def _dies_here() -> bool:
    """Whether this worker is the one to die: its rank (and replica group, when one is named)."""
    return os.environ.get("RANK", "0") == os.environ.get("DISTRIB_TEST_DIE_RANK", "1") and _in_dying_group()


def _hold_after_death(limit_s: float = 600.0) -> None:
    revive, marker = os.environ.get("DISTRIB_TEST_REVIVE_WHEN"), os.environ.get("DISTRIB_TEST_DIE_ONCE")
    if not (revive and marker and Path(marker).exists() and _in_dying_group()):
        return
    deadline = time.monotonic() + limit_s
    while not Path(revive).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    Path(f"{revive}.{os.environ.get('RANK', '0')}").touch()  # this restarted worker is up (tests.helpers.ft_pace)


def _die_in_allreduce(die_at: int, signum: signal.Signals) -> None:
    """This process's torchft Manager.allreduce, which kills the process once its die_at-th call is issued."""
    from torchft.manager import Manager

    issue, calls = Manager.allreduce, [0]

    def allreduce(self, tensor, *args, **kwargs):
        work = issue(self, tensor, *args, **kwargs)
        calls[0] += 1
        if calls[0] == die_at and first_death():
            os.kill(os.getpid(), signum)
        return work

    Manager.allreduce = allreduce


def _build(plain, dying, **kwargs):
    die_at = int(os.environ.get("DISTRIB_TEST_DIE_AT", "0"))
    _hold_after_death()
    if not (die_at and _dies_here()):
        return plain(**kwargs)
    signum = signal.Signals[os.environ.get("DISTRIB_TEST_DIE_SIGNAL", "SIGKILL")]
    if os.environ.get("DISTRIB_TEST_DIE_IN") == "allreduce":
        _die_in_allreduce(die_at, signum)
        return plain(**kwargs)
    model = dying(**kwargs)
    model.die_at, model.signum = die_at, signum
    return model


def network():
    return _build(Network, _DyingNetwork)


def dying(model):
    """Any model, killing its process as _DiesAt does (a forward pre-hook: any forward signature); as it is when
    DISTRIB_TEST_DIE_AT is unset or this is not the rank to die."""
    die_at = int(os.environ.get("DISTRIB_TEST_DIE_AT", "0"))
    _hold_after_death()
    if not (die_at and _dies_here()):
        return model
    signum, forwards = signal.Signals[os.environ.get("DISTRIB_TEST_DIE_SIGNAL", "SIGKILL")], [0]

    def count(module, args, kwargs):
        if module.training:
            forwards[0] += 1
            if forwards[0] == die_at and first_death():
                os.kill(os.getpid(), signum)

    model.register_forward_pre_hook(count, with_kwargs=True)
    return model


def gpt(vocab_size: int, seq_len: int, n_layers: int = 1, n_heads: int = 2, dim: int = 16):
    return _build(GPT, _DyingGPT, vocab_size=vocab_size, seq_len=seq_len, n_layers=n_layers, n_heads=n_heads, dim=dim)
