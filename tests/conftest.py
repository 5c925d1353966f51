"""Fixtures shared by test modules of both lanes (no sys.path edits: the repository root is on it by pyproject)."""

import os

# One thread per training process, in this process and in the runs it starts (before anything imports torch, whose
# OpenMP runtime reads it once): two test processes share the cores (-n 2), and a run that takes a thread per core
# beside another then has OpenMP threads spinning while they wait for each other. Measured on a loaded 2-core
# machine: in-process runs took 10x the CPU time (79 CPU-s against 7.5 for the same 5 tests). Launched workers get
# 1 from torchrun anyway; tests of distrib's own choice of threads start from clean_env(), which drops it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["tests.helpers.nothing_lost"]  # earlier, folder: a finished run, copied for each test
