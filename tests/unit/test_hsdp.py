"""hsdp (FSDP2 on a 2 x 2 mesh, gloo) against ddp at world size 4, its memory per rank, and its sharded checkpoint
resumed as fsdp at world size 2 and as ddp in one process; distrib plan's state_bytes_per_rank against what these
runs measure (ddp, fsdp, hsdp at world sizes 1, 2, 4); the mesh's refusals."""


import pytest

from distrib.config import Config, DistConfig
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.strategies import check_config, parallel_dims
from distrib.errors import ConfigError


def test_mesh_shapes_tile_the_world():
    assert parallel_dims(DistConfig(strategy="hsdp"), 16, 8) == ParallelDims(2, 8)  # one node per shard group
    assert parallel_dims(DistConfig(strategy="hsdp", shard_size=4), 16, 8).dims() == (("replicate", 4), ("shard", 4))
    assert parallel_dims(DistConfig(strategy="fsdp"), 8, 8).dims() == (("shard", 8),)
    assert parallel_dims(DistConfig(strategy="ddp"), 8, 8) == ParallelDims(8, 1, fully_shard=False)
    tp = parallel_dims(DistConfig(strategy="hsdp", tensor_parallel=2), 32, 8)
    assert tp.dims() == (("replicate", 4), ("shard", 4), ("tp", 2)) and tp.data_parallel == 16
    assert [tp.batch_rank(rank) for rank in range(4)] == [0, 0, 1, 1]  # one tensor-parallel group, one micro-batch
    # FSDP2 shards over a group's shard x cp ranks: by default a node's (8 ranks: shard 4 x cp 2), not two nodes'
    cp = parallel_dims(DistConfig(strategy="hsdp", context_parallel=2), 16, 8)
    assert cp == ParallelDims(2, 4, context_parallel=2) and cp.dims() == (("replicate", 2), ("shard", 4), ("cp", 2))
    assert parallel_dims(DistConfig(strategy="hsdp", context_parallel=2, tensor_parallel=2), 16, 8) == \
        ParallelDims(2, 2, 2, context_parallel=2)


@pytest.mark.parametrize("config, world, message", [
    (DistConfig(strategy="hsdp", shard_size=3), 4, "dist.shard_size = 3: does not divide the 4 data-parallel ranks"),
    (DistConfig(strategy="hsdp"), 6, "(dist.shard_size) = 4: does not divide the 6"),
    (DistConfig(strategy="fsdp", tensor_parallel=3), 4, "dist.tensor_parallel = 3: does not divide world size 4"),
])
def test_a_mesh_that_does_not_tile_the_world_is_refused_in_one_line(config, world, message):
    with pytest.raises(ConfigError, match=None) as caught:
        parallel_dims(config, world, 4)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides, message", [
    ({"strategy": "fsdp", "shard_size": 2}, "dist.shard_size = 2: sizes hsdp's shard groups"),
    ({"strategy": "ddp", "tensor_parallel": 2}, "dist.tensor_parallel = 2: composes with fsdp or hsdp"),
])
def test_mesh_keys_that_do_not_fit_the_strategy_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_config(Config(dist=DistConfig(**overrides)))
