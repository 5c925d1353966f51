"""A model factory whose worker kills itself mid-run, at an exact step
(`model.factory = tests.helpers.dying_model:network`).

DISTRIB_TEST_DIE_AT=N: the worker with RANK=DISTRIB_TEST_DIE_RANK (default 1) sends itself DISTRIB_TEST_DIE_SIGNAL
(default SIGKILL) in its Nth training forward, i.e. inside optimizer step N with one micro-step: a signal at an exact
step, however fast or slow the machine. Unset: a plain Network."""

import os
import signal

from distrib.models.network import Network


class _Dying(Network):
    def __init__(self, die_at: int, signum: signal.Signals):
        super().__init__()
        self.die_at, self.signum, self.num_forwards = die_at, signum, 0

    def forward(self, inputs):
        if self.training:
            self.num_forwards += 1
            if self.num_forwards == self.die_at:
                os.kill(os.getpid(), self.signum)
        return super().forward(inputs)


def network():
    die_at = int(os.environ.get("DISTRIB_TEST_DIE_AT", "0"))
    if die_at and os.environ.get("RANK", "0") == os.environ.get("DISTRIB_TEST_DIE_RANK", "1"):
        return _Dying(die_at, signal.Signals[os.environ.get("DISTRIB_TEST_DIE_SIGNAL", "SIGKILL")])
    return Network()
