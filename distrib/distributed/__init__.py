"""The distributed runtime of one worker: the launch environment read once, the device, backend and process group
(runtime); which peers are alive (peers); what the ranks decide together at a step boundary (agreement); and the
model's placement, DDP or FSDP2 wrapping, grad sync and state dicts (parallel, fsdp)."""

from distrib.distributed.agreement import RankAgreement
from distrib.distributed.parallel import parallelize, place_model, unwrap
from distrib.distributed.runtime import LaunchEnv, Runtime, open_runtime, read_launch_env

__all__ = ["LaunchEnv", "RankAgreement", "Runtime", "open_runtime", "parallelize", "place_model", "read_launch_env",
           "unwrap"]
