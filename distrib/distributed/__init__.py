"""The distributed runtime of one worker: the launch environment read once, the device, backend and process group
(runtime); which peers are alive (peers); what the ranks decide together at a step boundary (agreement); the mesh of
parallel degrees (mesh); and the strategies (ddp, fsdp, hsdp, tensor parallel), one object each, that own the
model's life (strategies, over the shared placement helpers in parallel and FSDP2's mechanics in fsdp)."""

from distrib.distributed.agreement import RankAgreement
from distrib.distributed.parallel import place_model, unwrap
from distrib.distributed.runtime import LaunchEnv, Runtime, open_runtime, read_launch_env
from distrib.distributed.strategies import Strategy, make_strategy

__all__ = ["LaunchEnv", "RankAgreement", "Runtime", "Strategy", "make_strategy", "open_runtime", "place_model",
           "read_launch_env", "unwrap"]
