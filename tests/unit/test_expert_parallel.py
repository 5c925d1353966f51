"""Expert parallel in one process: the rows an all-to-all delivers put in local-expert order (against a brute force),
the dispatch on one rank is the MoE layer's own forward and backward bitwise (the all-to-alls move nothing, the order
is the identity), the refusals before any worker starts, and distrib plan's expert bytes, all-to-all bytes and worst
imbalance; which modules are experts (one function, for the GPT's, transformers' and a PeftModel's), and a Hugging
Face mixture of experts from a folder-only factory checked before any worker in the workers' words. (Against one
process at world size 4: tests/integration/test_moe_gpt.py.)"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from distrib.config import DistConfig, load_config
from distrib.distributed.expert_modules import find_experts
from distrib.distributed.expert_parallel import apply_expert_parallel, check_model
from distrib.distributed.expert_routing import inverse, local_expert_order
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.strategies import check_config, parallel_dims
from distrib.errors import ConfigError
from distrib.models.gpt import GPT
from distrib.models.moe import MoE
from distrib.plan import Machine, plan_run, table
from distrib.plan.experts import all_to_all_split
from distrib.plan.layout import check_layout
from distrib.plan.saved import saved_bytes


def test_received_rows_go_in_local_expert_order_each_expert_s_rows_by_source():
    torch.manual_seed(0)
    by_source = torch.randint(0, 4, (3, 2))  # 3 sources x 2 local experts, rows per block
    labels = [(source, expert) for source in range(3) for expert in range(2)
              for _ in range(by_source[source, expert])]  # as they arrive: source-major, in order
    arrived = list(enumerate(labels))
    order = local_expert_order(by_source).tolist()
    wanted = sorted(arrived, key=lambda item: (item[1][1], item[1][0], item[0]))  # expert, then source, stable
    assert [arrived[i] for i in order] == wanted
    assert inverse(torch.tensor(order))[torch.tensor(order)].tolist() == list(range(len(labels)))


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def test_on_one_rank_the_dispatch_is_the_layer_itself_forward_and_backward(one_rank):
    torch.manual_seed(0)
    reference = MoE(16, 32, 4, 2, aux_loss_coef=0.01)
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.2)
    routed = MoE(16, 32, 4, 2, aux_loss_coef=0.01)
    routed.load_state_dict(reference.state_dict())
    assert apply_expert_parallel(routed, one_rank) == [routed.experts]
    assert isinstance(routed.experts.w1, DTensor)
    x = torch.randn(3, 5, 16)
    outs = [moe(x) for moe in (reference, routed)]
    assert torch.equal(outs[0], outs[1])
    for moe, out in zip((reference, routed), outs):
        (out.square().sum() + moe.aux_loss).backward()
    for (name, param), theirs in zip(reference.named_parameters(), routed.parameters()):
        grad = theirs.grad.full_tensor() if isinstance(theirs.grad, DTensor) else theirs.grad
        assert torch.equal(param.grad, grad), name


GPT_MOE = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64, n_experts = 8, top_k = 2, "
           "expert_hidden_dim = 64}", "data.name=text", "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32",
           "train.global_batch_size=16", "train.optimizer=adamw", "dist.device=cpu", "dist.strategy=fsdp"]


@pytest.mark.parametrize("overrides, world, says", [
    (["dist.strategy=ddp", "dist.expert_parallel=2"], 4, "dist.expert_parallel = 2: splits the experts over the ranks "
                                                         "of a shard group, and dist.strategy is ddp"),
    (["dist.expert_parallel=3"], 4, "dist.expert_parallel = 3: does not divide the 4 ranks of the fsdp ranks"),
    (["dist.strategy=hsdp", "dist.shard_size=2", "dist.expert_parallel=4"], 4,
     "dist.expert_parallel = 4: does not divide the 2 ranks of hsdp's shard groups (dist.shard_size)"),
    (["dist.expert_parallel=2", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64}"], 4,
     "dist.expert_parallel = 2: the model (GPT) has no experts to split"),
    (["dist.expert_parallel=4", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64, n_experts = 6}"], 4,
     "dist.expert_parallel = 4: layers.0.moe.experts holds 6 experts, which 4 ranks cannot split evenly"),
])
def test_what_expert_parallel_cannot_run_is_one_line_before_any_worker(overrides, world, says):
    config = load_config(None, [*GPT_MOE, *overrides])
    with pytest.raises(ConfigError) as raised:
        check_config(config)
        check_layout(config, world, world)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_the_degree_is_taken_from_the_shard_group():
    dims = parallel_dims(DistConfig(strategy="hsdp", shard_size=4, tensor_parallel=2, expert_parallel=2), 16, 8)
    assert dims == ParallelDims(2, 4, 2, expert_parallel=2) and dims.world_size == 16 and dims.data_parallel == 8
    assert [dims.coordinate(rank)["ep"] for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # shard % 2, tp inside
    with pytest.raises(ConfigError):
        check_model(GPT(n_layers=1, n_heads=2, dim=16), 2)


def test_one_function_says_which_modules_are_experts_and_how_many():
    """find_experts, which the launcher's check and each worker's expert parallel both read: the built-in GPT's
    experts (w1, w2, w3), transformers' fused experts (gate_up_proj, down_proj), and either inside a PeftModel."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers.pretrained import qwen3_moe

    gpt = find_experts(GPT(n_layers=2, n_heads=2, dim=16, n_experts=6, top_k=2), 2)
    assert {name: (e.num_experts, e.fused) for name, e in gpt.items()} == {
        "layers.0.moe.experts": (6, False), "layers.1.moe.experts": (6, False)}
    hf = find_experts(qwen3_moe(), 2)
    assert {name: (e.num_experts, e.fused) for name, e in hf.items()} == {
        "model.layers.0.mlp.experts": (4, True), "model.layers.1.mlp.experts": (4, True)}
    wrapped = find_experts(get_peft_model(qwen3_moe(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])), 4)
    assert {name: (e.num_experts, e.fused) for name, e in wrapped.items()} == {
        f"base_model.model.{name}": (4, True) for name in hf}


def _hf_moe(tmp_path, factory: str, num_experts: int, degree: int, kwargs: str = ""):
    """A Qwen3-MoE folder of num_experts experts, and the config of a run of it at dist.expert_parallel = degree with
    a factory that takes only the folder (the launcher builds it on the meta device before any worker starts)."""
    from tests.helpers.pretrained import qwen3_moe

    folder = tmp_path / "qwen3_moe"
    qwen3_moe(num_experts=num_experts).save_pretrained(folder)
    return folder, load_config(None, [
        f"model.factory=tests.helpers.pretrained:{factory}", f'model.kwargs={{folder = "{folder}"{kwargs}}}',
        f"model.init_from={folder}", "data.factory=tests.helpers.pretrained:token_dicts", "dist.device=cpu",
        "dist.strategy=fsdp", f"dist.expert_parallel={degree}", "train.global_batch_size=16"])


@pytest.mark.parametrize("factory, kwargs", [("moe_from_config", ""), ("lora_moe", ""),
                                             ("lora_moe", ', targets = "gate_proj,up_proj,down_proj"')])
def test_a_hugging_face_mixture_of_experts_from_a_folder_only_factory_passes_the_check_before_any_worker(
        tmp_path, factory, kwargs):
    """Its experts seen through a PeftModel, with LoRA on the attention or on the experts."""
    _, config = _hf_moe(tmp_path, factory, 4, 2, kwargs)
    assert check_layout(config, 4, 4).expert_parallel == 2


def test_experts_the_degree_does_not_divide_are_refused_before_any_worker_in_the_workers_words(tmp_path):
    """6 experts at dist.expert_parallel = 4: the launcher's check says what a worker's expert parallel would say
    (after its start-up) on the model it builds."""
    from tests.helpers.pretrained import moe_from_config
    from tests.helpers.support import fake_rank

    folder, config = _hf_moe(tmp_path, "moe_from_config", 6, 4)
    with pytest.raises(ConfigError) as before:
        check_layout(config, 4, 4)
    with fake_rank(0, 4), pytest.raises(ConfigError) as worker:
        apply_expert_parallel(moe_from_config(str(folder)), init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)))
    assert str(before.value) == str(worker.value) == (
        "dist.expert_parallel = 4: model.layers.0.mlp.experts holds 6 experts, which 4 ranks cannot split evenly; "
        "use a divisor of 6 (1, 2, 3, 6)")


@pytest.mark.parametrize("num_experts, degree, code", [(4, 2, 0), (6, 4, 2)])
def test_distrib_train_nproc_per_node_checks_the_folder_only_factory_s_experts_before_starting_workers(
        tmp_path, monkeypatch, capsys, num_experts, degree, code):
    """The command docs show, through the CLI up to the agent's start (which starts no worker here): 4 experts at
    ep 2 reach it, 6 at ep 4 are refused before it in the sentence a worker would say, exit 2."""
    import os

    from distrib import cli
    from distrib.launch import launcher

    started = []
    monkeypatch.setattr(launcher, "run_agent", lambda args: started.append(args.nproc_per_node) or 0)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the launcher sets the workers' environment in it
    folder, _ = _hf_moe(tmp_path, "moe_from_config", num_experts, degree)
    argv = ["train", "--nproc-per-node", "4", "--set", "model.factory=tests.helpers.pretrained:moe_from_config",
            "--set", f'model.kwargs={{folder = "{folder}"}}', "--set", f"model.init_from={folder}",
            "--set", "data.factory=tests.helpers.pretrained:token_dicts", "--set", "dist.device=cpu",
            "--set", "dist.strategy=fsdp", "--set", f"dist.expert_parallel={degree}",
            "--set", "train.global_batch_size=16", "--set", f"run.dir={tmp_path / 'run'}"]
    assert cli.main(argv) == code
    assert started == ([] if code else ["4"])
    if code:
        assert capsys.readouterr().err.strip().endswith(
            "dist.expert_parallel = 4: model.layers.0.mlp.experts holds 6 experts, which 4 ranks cannot split "
            "evenly; use a divisor of 6 (1, 2, 3, 6)")


def test_plan_counts_each_rank_s_experts_the_all_to_all_and_the_worst_imbalance(tmp_path):
    config = load_config(None, [*GPT_MOE, f"run.dir={tmp_path}", "dist.expert_parallel=2"])
    planned = plan_run(config, Machine(1, 4))
    # each rank holds 1/2 of each layer's 8 experts (ep), sharded over the other 2 ranks of its shard group
    whole = 2 * 3 * 8 * 64 * 64 * 4
    assert planned["expert_parameter_bytes_per_rank"] == whole // 4 and planned["moe_layers_per_rank"] == 2
    # AdamW: parameters, gradients, two moments, and a step count per tensor (6 of them)
    assert planned["expert_state_bytes_per_rank"] == 4 * whole // 4 + 6 * 4
    fsdp = plan_run(load_config(None, [*GPT_MOE, f"run.dir={tmp_path}"]), Machine(1, 4))
    assert fsdp["expert_parameter_bytes_per_rank"] == whole // 4 and fsdp["all_to_all_bytes_per_step_intra_node"] == 0
    assert planned["state_bytes_per_rank"] == fsdp["state_bytes_per_rank"]  # the same shares, cut another way
    # per layer and micro-batch: 4 x 32 tokens x top-2 rows of 64 fp32, to the experts and back, forward and backward;
    # half of them stay on the rank
    sent = 2 * 4 * (4 * 32 * 2 * 64 * 4)
    assert planned["all_to_all_bytes_per_step_intra_node"] == sent / 2
    # FSDP's rings: the dense parameters over the 4 ranks of shard_mod_ep x ep as under fsdp 4; each rank's half of
    # the experts over the 2 of shard_mod_ep, gathered in forward and backward (ring: 1/2 of the gathered bytes sent)
    rows = {(row["dimension"], row["kind"]): row["intra_node"] for row in planned["collectives"]}
    whole_rows = {(row["dimension"], row["kind"]): row["intra_node"] for row in fsdp["collectives"]}
    dense_gather = whole_rows["shard", "all-gather"] - 2 * 3 / 4 * whole
    assert rows["shard_mod_ep+ep", "all-gather"] == dense_gather
    assert rows["shard_mod_ep", "all-gather"] == 2 * (whole // 2) / 2
    assert rows["shard_mod_ep", "reduce-scatter"] == (whole // 2) / 2 and rows["ep", "all-to-all"] == sent / 2
    assert planned["collective_bytes_per_step_intra_node"] == sum(rows.values())
    assert planned["expert_rows_per_micro_batch"] == 256 and planned["expert_rows_per_micro_batch_worst"] == 512
    assert planned["expert_activation_bytes_worst"] == 512 * (64 + 4 * 64) * 4
    lines = table(planned, Machine(1, 4))
    assert "all-to-all / step" in lines and "at worst 512 (2.0x, dropless)" in lines
    assert "(shard_mod_ep 2 x ep 2)" in lines


def test_beside_context_parallel_a_rank_s_experts_shard_over_the_cp_ranks_and_the_plan_routes_a_rank_s_cut(tmp_path):
    """ep 2 x cp 2 at world size 4: no refusal; each rank's experts sharded over the 2 cp ranks that hold the same
    ones (shard_mod_ep 1 x cp 2), the dense parameters over all 4; distrib plan lays it out (against the runs:
    tests/integration/test_moe_gpt.py)."""
    from tests.helpers.support import fake_rank

    config = load_config(None, [*GPT_MOE, f"run.dir={tmp_path}", "dist.expert_parallel=2", "dist.context_parallel=2"])
    check_config(config)
    dims = parallel_dims(config.dist, 4, 4)
    assert dims.dims() == (("shard_mod_ep", 1), ("ep", 2), ("cp", 2)) and dims.describe() == "shard 2 (ep 2) x cp 2"
    for rank in range(4):
        with fake_rank(rank, 4):
            built = ParallelDims(1, 2, expert_parallel=2, context_parallel=2)
            built.build_mesh("cpu")
            ep, rest = built.expert_meshes()
            at = built.coordinate(rank)
            assert ep.mesh.tolist() == [built.rank_at(shard=shard, cp=at["cp"]) for shard in range(2)]
            assert rest.mesh.tolist() == [built.rank_at(shard=at["shard"], cp=cp) for cp in range(2)]
            assert built.data_parallel_mesh().mesh.tolist() == [0, 1, 2, 3]
    planned = plan_run(config, Machine(1, 4))
    # each rank 1/2 of each layer's experts (ep), sharded over the 2 cp ranks: 1/4 of them, as under ep 2 x fsdp 2
    assert planned["expert_parameter_bytes_per_rank"] == 2 * 3 * 8 * 64 * 64 * 4 // 4
    # a micro-batch of 8 windows of 32 (2 data ranks), each rank routing its 16 tokens of each, top-2
    assert planned["expert_rows_per_micro_batch"] == 8 * 16 * 2
    assert {row["dimension"] for row in planned["collectives"]} >= {"shard_cp", "shard_mod_ep_cp", "ep", "cp"}


def test_the_worst_case_activations_are_what_the_experts_save_per_row():
    torch.manual_seed(0)
    experts = MoE(64, 128, 4, 2).experts
    rows = torch.randn(100, 64, requires_grad=True)
    saved, _, _ = saved_bytes(lambda: experts(rows, torch.tensor([10, 20, 30, 40])), experts, [])
    assert saved - 4 * 4 == 100 * (64 + 4 * 128) * 4  # the row and SwiGLU's four intermediates (and 4 int32 offsets)


def test_an_all_to_all_crosses_nodes_for_the_ranks_of_its_group_elsewhere():
    dims = ParallelDims(1, 8, 2, expert_parallel=4)  # ep ranks 2 apart: 2 of the 4 on an 4-rank node
    assert all_to_all_split(dims, 4, 800) == (200, 400)
    assert all_to_all_split(dims, 8, 800) == (600, 0)
