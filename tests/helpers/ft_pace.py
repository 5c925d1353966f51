"""A callback that paces training (`train.callbacks = ["tests.helpers.ft_pace:PaceUntilFile"]`), so that replica
groups that go on alone still step (and hold quorums) while a killed group restarts, yet end soon after it healed:
a sleep of DISTRIB_TEST_PACE_S after each step until the file DISTRIB_TEST_PACE_UNTIL exists; and at step
DISTRIB_TEST_PACE_HOLD_AT, a wait for the file DISTRIB_TEST_PACE_HOLD_FOR (the restarted group's workers are up), so
that however long their start takes, the live groups have steps left to heal them in. A group held there holds no
quorum: the restarted one forms quorums alone (no heal) until the held ones go on and join."""

import os
import time
from pathlib import Path

HOLD_LIMIT_S = 600.0  # a missed event fails the test (the run's checks), never hangs it


class PaceUntilFile:
    def __init__(self):
        self.until = Path(os.environ["DISTRIB_TEST_PACE_UNTIL"])
        self.seconds = float(os.environ.get("DISTRIB_TEST_PACE_S", "0.25"))
        self.hold_at = int(os.environ.get("DISTRIB_TEST_PACE_HOLD_AT", "0"))
        self.hold_for = Path(os.environ.get("DISTRIB_TEST_PACE_HOLD_FOR", self.until))

    def on_step_end(self, step: int, loss) -> None:
        if self.until.exists():
            return
        deadline = time.monotonic() + HOLD_LIMIT_S
        while step == self.hold_at and not self.hold_for.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(self.seconds)
