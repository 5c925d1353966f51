"""A worker's start-up, timed by parts for the log line before its first step: where the seconds go between the
process starting and training (imports and the process group, data, the model, the checks, the state)."""

from __future__ import annotations

import os
import time


def _since_process_start() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
            return float(uptime.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Marks the end of each part; the first part is everything before the clock (imports, the process group)."""

    def __init__(self, first_part: str = "process start, imports and process group"):
        before = _since_process_start()
        self.parts = {first_part: before} if before is not None else {}
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now

    def line(self) -> str:
        said = ", ".join(f"{part} {seconds:.1f} s" for part, seconds in self.parts.items())
        return f"start-up {sum(self.parts.values()):.1f} s before the first step: {said}"
