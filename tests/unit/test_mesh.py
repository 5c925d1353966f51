"""The one mesh: every rank's coordinates as ParallelDims gives them (distrib plan's, without a process group) are
the ones torch's DeviceMesh gives that rank, also with the shard dimension split for expert parallel, the mesh is built
once per run, and a size-1 degree stays out of it."""

import pytest

from distrib.distributed.mesh import ParallelDims
from tests.helpers.support import fake_rank


@pytest.mark.parametrize("rank", [0, 5, 10, 15])
def test_coordinates_are_the_device_mesh_s_and_the_mesh_is_built_once(rank):
    dims = ParallelDims(replicate=2, shard=2, tensor_parallel=2, pipeline=2)
    with fake_rank(rank, 16):
        mesh = dims.build_mesh("cpu")
        assert dims.build_mesh("cpu") is mesh and dims.mesh is mesh
        at = dims.coordinate(rank)
        assert list(mesh.get_coordinate()) == [at["pp"], at["replicate"], at["shard"], at["tp"]]
        assert dims.rank_at(**at) == rank
        assert dims.batch_rank(rank) == mesh["replicate", "shard"]._flatten().get_local_rank()
        assert dims.leads_stage(rank) == (at["replicate"] == at["shard"] == at["tp"] == 0)


def test_each_wrapper_gets_the_data_parallel_dimensions_it_needs():
    assert ParallelDims(1, 4).dims() == (("shard", 4),)  # fsdp
    assert ParallelDims(2, 4).dims() == (("replicate", 2), ("shard", 4))  # hsdp
    assert ParallelDims(2, 1, pipeline=2).dims() == (("pp", 2), ("replicate", 2), ("shard", 1))  # ddp's stages
    assert ParallelDims.replicas(4).dims() == (("replicate", 4),)  # ddp: DDP over whole replicas
    assert ParallelDims(1, 2, 2, 2).loss_ranks == 4 and ParallelDims(1, 2, 2, 2).data_parallel == 2


@pytest.mark.parametrize("rank", [0, 5, 10, 31])
def test_expert_parallel_splits_the_shard_dimension_and_the_dense_parameters_keep_it_whole(rank):
    dims = ParallelDims(replicate=2, shard=4, tensor_parallel=2, pipeline=2, expert_parallel=2)
    assert dims.dims() == (("pp", 2), ("replicate", 2), ("shard_mod_ep", 2), ("ep", 2), ("tp", 2))
    assert dims.world_size == 32 and dims.data_parallel == 8 and dims.describe() == \
        "pp 2 x replicate 2 x shard 4 (ep 2) x tp 2"
    with fake_rank(rank, 32):
        mesh = dims.build_mesh("cpu")
        at = dims.coordinate(rank)
        assert list(mesh.get_coordinate()) == [at["pp"], at["replicate"], at["shard"] // 2, at["ep"], at["tp"]]
        assert dims.rank_at(**at) == rank
        dense = dims.data_parallel_mesh()  # one group of the shard ranks, in the order every rank sees
        assert dense.mesh_dim_names == ("replicate", "shard")
        assert list(dense.get_coordinate()) == [at["replicate"], at["shard"]]
        assert dims.batch_rank(rank) == dense._flatten().get_local_rank()
        ep, rest = dims.expert_meshes()
        assert ep.get_local_rank() == at["ep"] and rest.mesh_dim_names == ("replicate", "shard_mod_ep")
        shard_group = set(dense["shard"].mesh.tolist())  # the experts' two groups split this rank's shard group
        assert set(ep.mesh.tolist()) | set(rest["shard_mod_ep"].mesh.tolist()) <= shard_group
        assert len(shard_group) == 4 and set(ep.mesh.tolist()) & set(rest["shard_mod_ep"].mesh.tolist()) == {rank}
