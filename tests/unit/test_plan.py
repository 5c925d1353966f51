"""distrib plan's arithmetic and refusals, in process: collective bytes split by the mesh, and what train would refuse
refused in one line."""

import pytest

from distrib.cli import main
from distrib.config import DistConfig
from distrib.distributed.mesh import ParallelDims
from distrib.plan.cost import group_split as _group_split
from distrib.plan.cost import step_traffic


def collective_bytes(shape: ParallelDims, per_node, local_params, compute_bytes, grad_accum, reshard):
    return step_traffic(shape, DistConfig(reshard_after_forward=reshard), per_node, local_params, compute_bytes,
                        grad_accum)


@pytest.mark.parametrize("argv, message", [
    (["--set", "train.global_batch_size=30", "--world-size", "4"], "train.global_batch_size = 30: must divide"),
    (["--set", "dist.strategy=hsdp", "--set", "dist.shard_size=3", "--world-size", "4"],
     "dist.shard_size = 3: does not divide the 4 data-parallel ranks"),
    (["--set", "dist.strategy=fsdp", "--set", "dist.tensor_parallel=3", "--world-size", "4"],
     "dist.tensor_parallel = 3: does not divide world size 4"),
    (["--world-size", "6", "--nnodes", "4"], "--world-size 6: is not --nnodes 4 x --nproc-per-node"),
])
def test_plan_refuses_what_train_refuses_in_one_line(argv, message, capsys):
    assert main(["plan", "--set", "data.name=synthetic", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_collective_bytes_split_by_the_mesh():
    # a ring within a node sends (n-1)/n of the data; across 4 nodes of 8, 1/8 of it crosses (n_nodes-1)/n_nodes
    assert _group_split(8, 1, 8, 800, 1) == (700, 0)
    assert _group_split(32, 1, 8, 800, 1) == (700, 75)
    assert _group_split(4, 8, 8, 800, 2) == (0, 1200)  # hsdp's replicas: one rank per node, all-reduce
    intra, inter = collective_bytes(ParallelDims(4, 8), 8, 100, 2, 1, True)
    assert intra == 2 * 7 / 8 * 800 * 2 + 7 / 8 * 800 * 4 and inter == 2 * 3 / 4 * 400
    assert collective_bytes(ParallelDims(1, 8), 8, 100, 4, 1, True)[1] == 0  # one node: nothing crosses


def test_offloaded_shards_are_not_on_the_device():
    from distrib.config import load_config
    from distrib.plan import Machine, plan_run

    base = ["data.name=synthetic", "data.synthetic_train_size=256", "dist.strategy=fsdp", "dist.cpu_offload=true"]
    on_gpu = plan_run(load_config(None, [*base, "dist.device=cuda"]), Machine(1, 2))
    on_cpu = plan_run(load_config(None, [*base, "dist.device=cpu"]), Machine(1, 2))
    assert on_gpu["state_bytes_per_rank"] == 0 < on_cpu["state_bytes_per_rank"]  # host memory is the CPU's device


def test_start_up_is_told_from_steady_state():
    """Under fsdp a self-initialising GPT holds its shards and one whole tensor at start-up; a model that cannot
    initialise itself is built whole once, on rank 0's host (unless its weights come from model.init_from); ddp builds
    it whole on every rank of a node."""
    from distrib.config import load_config
    from distrib.plan import GIB, Machine, plan_run, table

    gpt = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64}", "data.name=text",
           "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32", "train.global_batch_size=8"]
    fsdp = plan_run(load_config(None, [*gpt, "dist.strategy=fsdp", "dist.device=cuda"]), Machine(1, 4))
    largest = 256 * 64 * 4  # the (tied) embedding
    assert fsdp["self_initialising"] and fsdp["startup_bytes_per_rank"] == fsdp["parameter_bytes_per_rank"] + largest
    assert fsdp["startup_host_bytes_per_node"] == 4 * largest and fsdp["host_bytes_per_node"] == 0
    ddp = plan_run(load_config(None, [*gpt, "dist.device=cuda"]), Machine(1, 4))
    assert ddp["startup_bytes_per_rank"] == ddp["whole_model_bytes"] == fsdp["whole_model_bytes"]
    assert ddp["startup_host_bytes_per_node"] == 4 * ddp["whole_model_bytes"]
    cnn = plan_run(load_config(None, ["data.name=synthetic", "dist.strategy=fsdp", "dist.device=cuda"]),
                   Machine(1, 2, host_memory=1e-6 * GIB))
    assert not cnn["self_initialising"] and not cnn["fits_host"] and cnn["fits"]
    assert cnn["startup_bytes_per_rank"] == cnn["parameter_bytes_per_rank"] + cnn["whole_model_bytes"]
    # With model.init_from it is never whole: each rank reads its shards (one tensor's block at a time, at most).
    loaded = plan_run(load_config(None, ["data.name=synthetic", "dist.strategy=fsdp", "dist.device=cuda",
                                         "model.init_from=/pretrained"]), Machine(1, 2))
    assert loaded["loads_weights"] and not cnn["loads_weights"]
    assert cnn["parameter_bytes_per_rank"] < loaded["startup_bytes_per_rank"] < cnn["startup_bytes_per_rank"]
    assert "each rank reads its shards from model.init_from" in table(loaded, Machine(1, 2))


GPT = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64}", "data.name=text",
       "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32", "train.global_batch_size=8",
       "train.optimizer=adamw"]


def test_the_peak_counts_the_gathered_blocks_the_optimizers_chunk_and_the_allocators_slack(monkeypatch):
    """Under fsdp the peak adds the root unit and two of the largest block's bytes on the CPU (three on an accelerator,
    which prefetches), and on a CPU run whose freed memory is kept, the allocator's slack; ddp gathers nothing."""
    from distrib.config import load_config
    from distrib.plan import Machine, plan_run, table
    from distrib.plan.host import SHARDED_KEPT_SLACK

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("DISTRIB_HOST_ALLOCATOR", "glibc")
    block = 4 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64)  # attention, SwiGLU feed-forward (hidden 192), two norms
    root = 4 * (256 * 64 + 64)  # the tied embedding and the final norm
    figures = {device: plan_run(load_config(None, [*GPT, "dist.strategy=fsdp", f"dist.device={device}"]),
                                Machine(1, 4)) for device in ("cpu", "cuda")}
    assert figures["cpu"]["gathered_bytes_per_rank"] == root + 2 * block
    assert figures["cuda"]["gathered_bytes_per_rank"] == root + 3 * block
    cpu = figures["cpu"]
    # 0.1M parameters: memory kept, and glibc keeps each block's freed gathers and gradients apart
    assert cpu["allocator_slack_bytes_per_rank"] == round(SHARDED_KEPT_SLACK["glibc"] * cpu["whole_model_bytes"])
    assert figures["cuda"]["allocator_slack_bytes_per_rank"] == 0
    # in the backward the activations not yet freed, or the gradients already reduced, whichever is more
    held = max(cpu["activation_bytes_per_micro_batch"], cpu["gradient_bytes_per_rank"])
    assert cpu["memory_bytes_per_rank"] == cpu["parameter_bytes_per_rank"] + cpu["optimizer_bytes_per_rank"] + \
        cpu["allocator_slack_bytes_per_rank"] + cpu["gathered_bytes_per_rank"] + held
    assert "allocator slack" in table(cpu, Machine(1, 4)) and "glibc, keeping freed memory" in cpu["host_allocator"]
    ddp = plan_run(load_config(None, [*GPT, "dist.device=cpu"]), Machine(1, 4))
    assert ddp["gathered_bytes_per_rank"] == 0


def test_the_allocator_that_will_run_sets_the_slack(monkeypatch):
    """plan counts the allocator a CPU run's workers will have: the one LD_PRELOAD names, else the one distrib's
    launcher preloads where it is installed, else glibc. A small sharded model keeps what it frees: glibc 4.3x the
    model's bytes over, tcmalloc 0.6x (scripts/bench_startup.py --plan); ddp its transient bytes again under either;
    a sharded model of 64 MiB or more returns it: none."""
    from distrib.config import load_config
    from distrib.launch import allocator
    from distrib.plan import Machine, plan_run
    from distrib.plan.host import KEPT_SLACK, SHARDED_KEPT_SLACK, host_allocator

    tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    assert host_allocator({"LD_PRELOAD": tcmalloc}) == "tcmalloc"
    assert host_allocator({"LD_PRELOAD": "/opt/libmine.so"}) == "glibc"
    monkeypatch.setattr(allocator, "find_library", lambda name: tcmalloc)  # installed: the launcher preloads it
    assert host_allocator({}) == "tcmalloc" and host_allocator({"DISTRIB_HOST_ALLOCATOR": "glibc"}) == "glibc"
    monkeypatch.setattr(allocator, "find_library", lambda name: None)  # a fresh machine: glibc
    assert host_allocator({}) == "glibc"
    monkeypatch.delenv("DISTRIB_HOST_ALLOCATOR", raising=False)
    sharded = load_config(None, [*GPT, "dist.strategy=fsdp", "dist.device=cpu"])
    monkeypatch.setenv("LD_PRELOAD", tcmalloc)
    on_tcmalloc = plan_run(sharded, Machine(1, 4))
    monkeypatch.delenv("LD_PRELOAD")
    on_glibc = plan_run(sharded, Machine(1, 4))
    assert on_tcmalloc["host_allocator"] == "tcmalloc, keeping freed memory"
    assert on_glibc["host_allocator"] == "glibc, keeping freed memory"
    for figures, name in ((on_tcmalloc, "tcmalloc"), (on_glibc, "glibc")):
        slack = round(SHARDED_KEPT_SLACK[name] * figures["whole_model_bytes"])
        assert figures["allocator_slack_bytes_per_rank"] == slack
    assert on_glibc["memory_bytes_per_rank"] - on_tcmalloc["memory_bytes_per_rank"] == \
        on_glibc["allocator_slack_bytes_per_rank"] - on_tcmalloc["allocator_slack_bytes_per_rank"]
    ddp = plan_run(load_config(None, [*GPT, "dist.device=cpu"]), Machine(1, 4))
    assert ddp["allocator_slack_bytes_per_rank"] == round(KEPT_SLACK * ddp["activation_bytes_per_micro_batch"])
    large = plan_run(load_config(None, [*GPT, "model.kwargs={n_layers = 8, n_heads = 8, dim = 512}",
                                        "dist.strategy=fsdp", "dist.device=cpu"]), Machine(1, 4))  # 103 MB: returned
    assert large["allocator_slack_bytes_per_rank"] == 0 and "glibc, returning" in large["host_allocator"]


def test_ddp_counts_its_gradient_buckets():
    """DDP keeps a bucket copy of the gradients (the 25M GPT's ddp workers measured 0.79 of plan without it), unless
    speed.gradient_as_bucket_view makes the gradients views of the buckets."""
    from distrib.config import load_config
    from distrib.plan import Machine, plan_run, table

    copied = plan_run(load_config(None, [*GPT, "dist.device=cuda"]), Machine(1, 4))
    viewed = plan_run(load_config(None, [*GPT, "dist.device=cuda", "speed.gradient_as_bucket_view=true"]),
                      Machine(1, 4))
    assert copied["ddp_bucket_bytes_per_rank"] == copied["gradient_bytes_per_rank"] > 0 == \
        viewed["ddp_bucket_bytes_per_rank"]
    assert copied["memory_bytes_per_rank"] - viewed["memory_bytes_per_rank"] == copied["gradient_bytes_per_rank"]
    assert "DDP gradient buckets" in table(copied, Machine(1, 4)) and "buckets" not in table(viewed, Machine(1, 4))


def _fixes(figures: dict) -> dict[str, dict]:
    return {fix["fix"]: fix for fix in figures["fixes"]}


def test_does_not_fit_names_its_fixes_each_with_the_peak_plan_gives_it():
    """A run whose step does not fit the device names what would: activation checkpointing, more accumulation (a
    smaller micro-batch), more shards (ddp: fsdp; fsdp: more nodes), the state on the host; each with the peak that
    `distrib plan` of the run with that fix says (checkpointing exactly; the others to the rounding of the shards and
    of the activations of a smaller micro-batch)."""
    from distrib.config import load_config
    from distrib.plan import Machine, plan_run, table

    base = [*GPT, "dist.device=cuda", "train.global_batch_size=16"]
    fits = plan_run(load_config(None, base), Machine(1, 4))
    assert fits["fits"] and fits["fixes"] == []
    short = Machine(1, 4, device_memory=fits["memory_bytes_per_rank"] - 1)
    ddp = plan_run(load_config(None, base), short)
    fixes = _fixes(ddp)
    assert not ddp["fits"] and list(fixes) == [
        "--set speed.activation_checkpointing=blocks", "--set train.grad_accum_steps=2 (micro-batch 2)",
        "--set dist.strategy=fsdp", "--set dist.strategy=fsdp --set dist.cpu_offload=true"]
    assert all(fix["fits"] for fix in fixes.values())
    for fix, override, tolerance in (
            ("--set speed.activation_checkpointing=blocks", "speed.activation_checkpointing=blocks", 0),
            ("--set train.grad_accum_steps=2 (micro-batch 2)", "train.grad_accum_steps=2", 0.02),
            ("--set dist.strategy=fsdp", "dist.strategy=fsdp", 0.05)):
        planned = plan_run(load_config(None, [*base, override]), short)["memory_bytes_per_rank"]
        assert fixes[fix]["memory_bytes_per_rank"] == pytest.approx(planned, rel=tolerance, abs=0), fix
    lines = table(ddp, short).splitlines()
    said = lines[[i for i, line in enumerate(lines) if line.startswith("device memory")][0] + 1]
    assert said.startswith("fixes") and "--set speed.activation_checkpointing=blocks" in said and "fits" in said
    fsdp = load_config(None, [*base, "dist.strategy=fsdp"])
    one, two = (plan_run(fsdp, Machine(nnodes, 4))["memory_bytes_per_rank"] for nnodes in (1, 2))
    more = _fixes(plan_run(fsdp, Machine(1, 4, device_memory=(one + two) / 2)))
    assert more["--nnodes 2 (8 data-parallel ranks)"]["memory_bytes_per_rank"] == pytest.approx(two, rel=0.05)


def test_rank_0s_end_of_run_save_is_counted_and_at_most_one_file():
    """Under a sharded strategy rank 0 gathers model.pt whole at the run's end (the rest of weights/ every rank
    writes itself): plan counts it on rank 0's node, and a model over model.max_shard_size has no model.pt, so rank 0
    never holds more than one file above the other ranks; ddp's rank 0 holds the whole model anyway."""
    from distrib.config import load_config
    from distrib.plan import Machine, plan_run, table

    cpu = [*GPT, "dist.device=cpu"]
    sharded = plan_run(load_config(None, [*cpu, "dist.strategy=fsdp"]), Machine(1, 4))
    assert sharded["save_bytes_rank0"] == sharded["whole_model_bytes"] > 0
    assert sharded["save_host_bytes_per_node"] == 4 * sharded["state_bytes_per_rank"] + sharded["save_bytes_rank0"]
    said = table(sharded, Machine(1, 4))
    assert "end-of-run save" in said and "model.pt gathered whole" in said
    split = plan_run(load_config(None, [*cpu, "dist.strategy=fsdp", "model.max_shard_size=100KB"]), Machine(1, 4))
    assert split["whole_model_bytes"] > 100_000 and split["save_bytes_rank0"] == 0
    assert plan_run(load_config(None, cpu), Machine(1, 4))["save_bytes_rank0"] == 0  # ddp


def test_the_bubble_is_the_ramp_of_the_schedule():
    from distrib.plan.pipeline import bubble_share

    assert bubble_share(1, 8) == 0
    assert bubble_share(2, 2) == pytest.approx(1 / 3)  # (P - 1) / (M + P - 1)
    assert bubble_share(4, 8) == pytest.approx(3 / 11)
    assert bubble_share(2, 4, stages_per_rank=2) == pytest.approx(1 / 9)  # interleaved: (P - 1) / (V M + P - 1)


def test_microbatches_in_flight_follow_the_schedule():
    """gpipe holds every microbatch's activations; 1f1b P - r on pipeline rank r; interleaved the forwards torch's
    schedule runs before its first backward, and one more, in rounds of P microbatches stage by stage."""
    from distrib.plan.pipeline import in_flight

    assert [in_flight("gpipe", 4, 1, 8, rank) for rank in range(4)] == [[8]] * 4
    assert [in_flight("1f1b", 4, 1, 8, rank) for rank in range(4)] == [[4], [3], [2], [1]]
    assert in_flight("1f1b", 4, 1, 2, 0) == [2]  # never more than the microbatches
    assert [in_flight("interleaved_1f1b", 2, 2, 4, rank) for rank in range(2)] == [[3, 2], [2, 1]]
    assert in_flight("interleaved_1f1b", 2, 2, 2, 0) == [2, 2]  # all V M of them at most


PP_GPT = ["model.name=gpt", "model.kwargs={n_layers = 4, n_heads = 4, dim = 64, tie_weights = false}",
          "data.name=text", "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32",
          "train.global_batch_size=16", "train.optimizer=adamw", "dist.device=cpu", "dist.strategy=fsdp",
          "dist.pipeline_parallel=2"]


def test_pipeline_stages_their_state_and_what_is_sent_between_them():
    """pp 2 x fsdp 2: every unit in one stage, in order; a rank's stages hold its state; each rank sends a
    microbatch's activation (or its gradient) per microbatch: 8 windows of 32 x 64 fp32 per micro-batch. pp is the
    outermost dimension: on 2 nodes of 2 the stages are on different nodes."""
    from distrib.config import load_config
    from distrib.plan import Machine, plan_run, table

    config = load_config(None, PP_GPT)
    one_node, two_nodes = plan_run(config, Machine(1, 4)), plan_run(config, Machine(2, 2))
    ranks = one_node["stages"]
    assert [s["units"] for rank in ranks for s in rank["stages"]] == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    assert all(rank["state_bytes"] == sum(s["state_bytes"] for s in rank["stages"]) for rank in ranks)
    assert one_node["state_bytes_per_rank"] == max(rank["state_bytes"] for rank in ranks)
    assert one_node["memory_bytes_per_rank"] == max(rank["memory_bytes"] for rank in ranks)
    assert [s["microbatches_in_flight"] for rank in ranks for s in rank["stages"]] == [2, 1]
    sent = 8 * 32 * 64 * 4
    assert (one_node["pipeline_bytes_per_step_intra_node"], one_node["pipeline_bytes_per_step_inter_node"]) == \
        (sent, 0)
    assert (two_nodes["pipeline_bytes_per_step_intra_node"], two_nodes["pipeline_bytes_per_step_inter_node"]) == \
        (0, sent)
    assert two_nodes["collective_bytes_per_step_inter_node"] == sent  # fsdp's shard groups stay on their node
    assert one_node["bubble_share"] == pytest.approx(1 / 3) and "bubble 33.3% of a step" in table(one_node,
                                                                                                   Machine(1, 4))
    assert plan_run(load_config(None, PP_GPT[:-1]), Machine(1, 4))["stages"] == []


def test_tensor_parallel_traffic_counts_the_embedding_and_the_gathered_logits():
    """Qwen2's own plan, as a run's process groups carry it (scripts/bench_traffic.py): per position, each row-wise
    projection's output in forward (o_proj's again when checkpointing recomputes a block), each column-wise
    projection's input gradient in backward (q, k, v, gate and up apiece), the row-wise embedding's output once, the
    gathered lm_head's logits half an all-reduce and its input gradient once; per microbatch, a pipeline rank's share
    of the layers."""
    import torch

    from distrib.config import load_config
    from distrib.plan.traffic import tp_activations
    from tests.helpers.pretrained import qwen2

    model = qwen2()
    config, tokens = model.config, torch.zeros(2, 8, dtype=torch.long)
    hidden, layers = config.hidden_size, config.num_hidden_layers

    def per_position(recomputed: int) -> float:  # o_proj and down_proj forward, 5 column-wise backward
        return layers * ((2 + recomputed) * hidden + 5 * hidden) + hidden + config.vocab_size / 2 + hidden

    run = load_config(None, ["data.name=synthetic"])
    tp = ParallelDims(1, 2, tensor_parallel=2)
    assert tp_activations(model, tp, tokens, run) == 16 * per_position(0)
    checkpointed = load_config(None, ["data.name=synthetic", "speed.activation_checkpointing=blocks"])
    assert tp_activations(model, tp, tokens, checkpointed) == 16 * per_position(1)  # o_proj again, not down_proj
    staged = load_config(None, ["data.name=synthetic", "dist.pipeline_parallel=2"])  # 2 microbatches, half the layers
    assert tp_activations(model, ParallelDims(1, 1, tensor_parallel=2, pipeline=2), tokens, staged) == \
        16 / 2 * per_position(0) / 2
    assert tp_activations(model, ParallelDims(1, 2), tokens, run) == 0


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_replica_groups_are_planned_as_one_groups_world_plus_the_all_reduce_across_them(strategy):
    """2 fault-tolerant replica groups at world 8: each rank holds the state of the layout of one group's 4 ranks (was
    planned as fsdp 8), and all-reduces what it holds of the gradients (fsdp: its shard, ddp: the whole) in fp32 with
    the same rank of the other group: on one node within it, on two nodes (a group each) across them."""
    from distrib.config import load_config
    from distrib.plan import Machine, plan_run

    keys = ["data.name=synthetic", "data.synthetic_train_size=256", f"dist.strategy={strategy}"]
    alone = plan_run(load_config(None, keys), Machine(1, 4))
    state = ["parameter_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_bytes_per_rank", "state_bytes_per_rank"]
    held = alone["parameter_bytes_per_rank"]  # fp32 parameters: the bytes of the gradients a rank all-reduces
    for machine, across in ((Machine(1, 8), _group_split(2, 4, 8, held, 2)), (Machine(2, 4), (0, held))):
        groups = plan_run(load_config(None, [*keys, "dist.fault_tolerant_groups=2"]), machine)
        assert [groups[key] for key in state] == [alone[key] for key in state]
        assert groups["mesh"] == alone["mesh"] and groups["data_parallel_size"] == 8  # the batch streams of both
        assert groups["named_collectives"] == [{"name": "all-reduce across replica groups", "intra_node": across[0],
                                                "inter_node": across[1]}]
        alone_here = step_traffic(ParallelDims(4, 1, fully_shard=False) if strategy == "ddp" else ParallelDims(1, 4),
                                  DistConfig(strategy=strategy), machine.nproc_per_node, held // 4, 4, 1)
        assert (groups["collective_bytes_per_step_intra_node"], groups["collective_bytes_per_step_inter_node"]) == (
            alone_here[0] + across[0], alone_here[1] + across[1])
    assert across == (0, held) and _group_split(2, 4, 8, held, 2) == (held, 0)
