"""The declared degrees (distrib.distributed.dimensions): their order, their keys, and that the mesh and the words
composed from their declarations are the ones ParallelDims records and says, for the layouts the strategies make;
and that the worker, the trainer and the CLI name none of them."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from distrib.config import DistConfig
from distrib.distributed import dimensions
from distrib.distributed.dimensions import DIMENSIONS
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.strategies import parallel_dims
from distrib.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _steps(dims: ParallelDims) -> list[str]:
    """parallelize's steps for dims, by the degree each is of ('prepare': parallelize's own)."""
    def prepare(model, layout):
        return model

    return [step.__self__.name if hasattr(step, "__self__") else "prepare"
            for step in dimensions.parallelize_steps(dims, prepare)]


def test_the_declared_order_and_parallelize_s():
    assert [d.name for d in DIMENSIONS] == ["replica groups", "pipeline parallel", "data parallel", "context parallel",
                                            "tensor parallel", "expert parallel"]
    every = ParallelDims(1, 4, tensor_parallel=2, pipeline=2, expert_parallel=2)
    assert _steps(every) == ["tensor parallel", "expert parallel", "prepare", "data parallel"]
    assert _steps(ParallelDims.replicas(2)) == ["prepare", "data parallel"]  # a degree off has no step


def test_each_degree_owns_dist_keys_no_other_does():
    owned = [key for dimension in DIMENSIONS for key in dimension.keys]
    assert set(owned) <= {f.name for f in fields(DistConfig)} and len(owned) == len(set(owned))


LAYOUTS = [  # (strategy, world, local world, other dist keys)
    ("fsdp", 4, 4, {}), ("hsdp", 8, 4, {}), ("ddp", 4, 4, {}), ("ddp", 4, 4, {"pipeline_parallel": 2}),
    ("fsdp", 8, 8, {"tensor_parallel": 2, "pipeline_parallel": 2}),
    ("fsdp", 8, 8, {"expert_parallel": 2, "tensor_parallel": 2}),
    ("hsdp", 32, 8, {"shard_size": 4, "expert_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2}),
]


@pytest.mark.parametrize("strategy, world, local, keys", LAYOUTS)
def test_the_declared_mesh_and_words_are_the_mesh_s(strategy, world, local, keys):
    dims = parallel_dims(DistConfig(strategy=strategy, **keys), world, local)
    assert dimensions.mesh_dims(dims) == dims.dims()
    assert dimensions.describe(dims) == dims.describe()
    named = dims.pipeline * dims.tensor_parallel > 1  # what the start-up line spelt out before the declarations
    assert dimensions.layout_words(dims) == (f": {dims.describe()}" if named else "")


def test_the_words_of_a_layout():
    every = ParallelDims(replicate=2, shard=4, tensor_parallel=2, pipeline=2, expert_parallel=2)
    assert dimensions.describe(every) == "pp 2 x replicate 2 x shard 4 (ep 2) x tp 2"
    assert dimensions.layout_words(ParallelDims(1, 4, expert_parallel=2)) == ""  # its experts have a line of their own
    # a pipeline's stages are FSDP2 modules (Dimension.shards_state): ddp's are sharded over a shard group of 1
    assert dimensions.describe(parallel_dims(DistConfig(strategy="ddp", pipeline_parallel=2), 4, 4)) == \
        "pp 2 x replicate 2 x shard 1"


def test_replica_groups_add_no_mesh_dimension_and_multiply_the_batch_streams():
    dims = parallel_dims(DistConfig(strategy="fsdp", fault_tolerant_groups=2), 4, 4)
    assert dimensions.mesh_dims(dims) == dims.dims() == (("shard", 4),)
    assert (dims.batch_ranks, dims.data_parallel) == (8, 4)
    assert dimensions.describe(dims) == "2 replica groups x shard 4"
    assert dimensions.layout_words(dims) == ": 2 replica groups x shard 4"
    assert dimensions.worlds(DistConfig(fault_tolerant_groups=2), 8, 8) == 2  # the plan's world: a group's is 4
    with pytest.raises(ConfigError, match="dist.fault_tolerant_groups = 3: does not divide world size 8"):
        dimensions.worlds(DistConfig(fault_tolerant_groups=3), 8, 8)
    with pytest.raises(ConfigError, match="dist.fault_tolerant_groups = 2: groups of 6 ranks straddle nodes of 4"):
        dimensions.worlds(DistConfig(fault_tolerant_groups=2), 12, 4)


# with the modules split off them: the trainer's step and bookkeeping, the worker's set-up, the CLI's commands
@pytest.mark.parametrize("path", ["distrib/worker.py", "distrib/training/trainer.py", "distrib/training/step.py",
                                  "distrib/training/bookkeeping.py", "distrib/training/state.py",
                                  "distrib/training/building.py", "distrib/training/resuming.py",
                                  "distrib/training/opening.py", "distrib/training/finish.py",
                                  "distrib/cli/__init__.py", "distrib/cli/parser.py", "distrib/cli/train.py",
                                  "distrib/cli/commands.py"])
def test_the_worker_trainer_and_cli_name_no_declared_degree(path):
    text = (ROOT / path).read_text()
    named = ["tensor_parallel", "expert_parallel", "pipeline_parallel", "fault_tolerant_groups", "replica_group",
             "ReplicaGroups", "fault_tolerance", "dims.pipeline", "dims.tensor_parallel", "dims.expert_parallel"]
    assert [word for word in named if word in text] == []


# the modules beside context parallel's that ask generic questions in place of naming it: how many ranks hold parts of
# one sample's tokens (ParallelDims.token_split), read one micro-batch (batch_sharers), shard the parameters and the
# experts (shard_group, expert_shard_group), which degrees took a share of the world (dimensions.shares), and the
# bytes the degrees' forwards count (StepCost.counted_bytes)
@pytest.mark.parametrize("path", ["distrib/distributed/dimensions/experts.py", "distrib/distributed/dimensions/data.py",
                                  "distrib/distributed/strategies/fsdp.py", "distrib/training/experts.py",
                                  "distrib/plan/experts.py", "distrib/plan/traffic.py", "distrib/distributed/fsdp.py"])
def test_the_modules_beside_context_parallel_name_it_not(path):
    assert re.findall(r"context.parallel|\bcp\b|\bCP\b|_CP\b", (ROOT / path).read_text(), re.IGNORECASE) == []


def test_the_generic_counts_are_context_parallel_s_where_it_is_on():
    on = parallel_dims(DistConfig(strategy="hsdp", context_parallel=2, tensor_parallel=2, expert_parallel=2), 16, 8)
    assert (on.replicate, on.shard) == (2, 2)  # a node's 8 ranks: shard 2 x cp 2 x tp 2
    assert (on.token_split, on.batch_sharers, on.shard_group(), on.expert_shard_group()) == \
        (2, 4, ("shard_cp", 4), ("shard_mod_ep_cp", 2))
    off = parallel_dims(DistConfig(strategy="hsdp", tensor_parallel=2, expert_parallel=2), 16, 8)
    assert (off.replicate, off.shard) == (2, 4)
    assert (off.token_split, off.batch_sharers, off.shard_group(), off.expert_shard_group()) == \
        (1, 2, ("shard", 4), ("shard_mod_ep", 2))
    config = DistConfig(strategy="hsdp", context_parallel=2, tensor_parallel=2, shard_size=3)
    assert [(d.name, share) for d, share in dimensions.shares(config, 16, 8) if share > 1] == \
        [("context parallel", 2), ("tensor parallel", 2)]
    with pytest.raises(ConfigError, match=r"shard_size = 3: does not divide the 4 data-parallel ranks \(world size 16 "
                                          r"/ context parallel 2 / tensor parallel 2\)"):
        parallel_dims(config, 16, 8)
