"""Saves a 16 MB checkpoint to one path over and over with save_atomic until killed (for the SIGKILL test).

argv: PATH"""

import sys

import torch

from distrib.checkpoint.format import FORMAT, VERSION, digest, save_atomic

if __name__ == "__main__":
    step = 0
    while True:
        step += 1
        state = {"format": FORMAT, "version": VERSION, "progress": {"step": step},
                 "model": {"w": torch.full((4_000_000,), float(step))}}
        state["checksum"] = digest(state)
        save_atomic(state, sys.argv[1])
        print(step, flush=True)
