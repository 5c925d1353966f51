"""Launching: what runs around the workers, in the parent process and at the edges of each worker's life.

The launcher (torch's elastic agent with better defaults, SLURM detection, checks before any worker starts) and the
only writer of the launch environment; what it reports of its workers' ends (reporting: one line per way of failing);
the lifeline that ties each worker to it; preemption signals; the run's folders and their locks; `distrib doctor`.
No module here imports torch at import time."""

from distrib.launch.launcher import launch_trainer
from distrib.launch.launcher import main as launch

__all__ = ["launch", "launch_trainer"]
