"""The plan's figures as the lines `distrib plan` prints: the table, its pipeline rows and its fixes (the dry run's
lines under it: distrib.plan.dry_run_rows)."""

from __future__ import annotations

from distrib.plan.cost import collective_rows
from distrib.plan.experts import expert_rows
from distrib.plan.goodput import rows as goodput_rows
from distrib.plan.machine import GB, GIB, Machine


def sized(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def table(figures: dict, machine: Machine) -> str:
    """The plan as the lines `distrib plan` prints."""
    f = figures
    rows = [*_state_rows(f), *_pipeline_rows(f), *expert_rows(f, sized), *_traffic_rows(f, machine),
            *_memory_rows(f), *fix_rows(f), *_host_rows(f, machine),
            *(goodput_rows(f) if "goodput_at_optimum" in f else [])]
    return "\n".join(f"{name:<26} {value}" for name, value in rows)


def _state_rows(f: dict) -> list[tuple[str, str]]:
    """The model, the world and its mesh, a rank's state and a micro-batch's activations."""
    mesh = " x ".join(f"{name} {size}" for name, size in f["mesh"].items())
    return [
        ("model", f"{f['num_parameters'] / 1e9:.3f} B parameters"),
        ("world", f"{f['nnodes']} node(s) x {f['nproc_per_node']} = {f['world_size']} ranks, {f['strategy']} "
                  f"({mesh})"),
        ("parameters / rank", sized(f["parameter_bytes_per_rank"])),
        ("gradients / rank", sized(f["gradient_bytes_per_rank"])),
        ("optimizer state / rank", sized(f["optimizer_bytes_per_rank"])),
        ("state_bytes_per_rank", f"{sized(f['state_bytes_per_rank'])} ({f['state_bytes_per_rank']} bytes)"),
        ("activations / micro-batch", f"{sized(f['activation_bytes_per_micro_batch'])}; with activation "
                                      f"checkpointing {sized(f['activation_bytes_per_micro_batch_checkpointed'])}"
                                      + (" (all stages; a pipeline rank's below)" if f["pipeline_parallel"] > 1
                                         else "")),
    ]


def _traffic_rows(f: dict, machine: Machine) -> list[tuple[str, str]]:
    """The batch, and the collectives' bytes per step and rank: named ones and each mesh dimension's."""
    return [
        ("batch", f"global {f['global_batch_size']} = {f['data_parallel_size']} data-parallel ranks x "
                  f"{f['grad_accum_steps']} grad-accum steps x micro-batch {f['micro_batch_size']}"),
        ("collectives / step", f"{sized(f['collective_bytes_per_step_intra_node'])} intra-node, "
                               f"{sized(f['collective_bytes_per_step_inter_node'])} inter-node per rank"),
        *(("", f"of which the {c['name']}: {sized(c['intra_node'])} intra-node, {sized(c['inter_node'])} "
               "inter-node") for c in f["named_collectives"]),
        *collective_rows(f, sized, machine.intra_node_bandwidth, machine.inter_node_bandwidth),
    ]


def _memory_rows(f: dict) -> list[tuple[str, str]]:
    """Start-up, what a step holds beyond its state and activations, and the device memory's verdict."""
    return [
        ("start-up / rank", f"{sized(f['startup_bytes_per_rank'])} while building and loading ("
                            + ("each rank reads its shards from model.init_from" if f["loads_weights"] else
                               "the model initialises its own shards" if f["self_initialising"] else
                               "rank 0 also builds the whole model in host memory") + ")"),
        ("gathered in flight", f"{sized(f['gathered_bytes_per_rank'])} " + (
            "(the root unit, and the largest block's bytes at its backward)" if f["pipeline_parallel"] == 1 else
            f"(its stages' parameters, from their first backward to the step's end), their gradients unsharded "
            f"{sized(f['unsharded_gradient_bytes_per_rank'])}, receive buffers "
            f"{sized(f['pipeline_buffer_bytes_per_rank'])}")),
        ("optimizer temporaries", sized(f["optimizer_temporary_bytes_per_rank"])),
        *([("DDP gradient buckets", f"{sized(f['ddp_bucket_bytes_per_rank'])} (a copy of the gradients; "
                                    "speed.gradient_as_bucket_view = true shares them)")]
          if f["ddp_bucket_bytes_per_rank"] else []),
        ("allocator slack", f"{sized(f['allocator_slack_bytes_per_rank'])}"
                            + (f" ({f['host_allocator']} on the host)" if f["host_allocator"] else "")),
        ("device memory", f"{'fits' if f['fits'] else 'DOES NOT FIT'}: {sized(f['memory_bytes_per_rank'])} of "
                          f"{sized(f['device_memory_bytes'])} (the step's peak: parameters, optimizer, gathered, "
                          "the larger of activations and gradients, slack)"),
    ]


def _host_rows(f: dict, machine: Machine) -> list[tuple[str, str]]:
    """The end-of-run save, host memory per node, and the step time communication bounds."""
    return [
        ("end-of-run save", f"rank 0 holds {sized(f['save_bytes_rank0'])} more than the others" + (
            " (model.pt gathered whole, one file of at most model.max_shard_size)" if f["save_bytes_rank0"] else
            " (every rank writes its own blocks of weights/)")),
        ("host memory / node", f"{'fits' if f['fits_host'] else 'DOES NOT FIT'}: "
                               f"{sized(f['startup_host_bytes_per_node'])} at start-up, "
                               f"{sized(f['host_bytes_per_node'])} in steady state, "
                               f"{sized(f['save_host_bytes_per_node'])} at the end-of-run save, of "
                               f"{sized(f['host_memory_bytes'])}"),
        ("step time >=", f"{f['step_seconds_lower_bound'] * 1e3:.1f} ms from communication at "
                         f"{machine.intra_node_bandwidth / GB:g} GB/s intra-node, "
                         f"{machine.inter_node_bandwidth / GB:g} GB/s inter-node"),
    ]


def fix_rows(f: dict) -> list[tuple[str, str]]:
    """Under DOES NOT FIT: each fix with the peak it gives (distrib.plan.fixes), those that fit first."""
    if f["fits"]:
        return []
    ordered = sorted(f["fixes"], key=lambda fix: not fix["fits"])
    if not ordered:
        return [("fixes", "none that plan knows lowers the peak: a device with more memory (--device-memory)")]
    return [("fixes" if i == 0 else "", f"{fix['fix']}: {sized(fix['memory_bytes_per_rank'])}, "
                                        f"{'fits' if fix['fits'] else 'does not fit'}")
            for i, fix in enumerate(ordered)]


def _pipeline_rows(f: dict) -> list[tuple[str, str]]:
    """Under pipeline parallel: the schedule and its bubble, each pipeline rank's stages, what each holds, and the
    activations sent between stages."""
    if f["pipeline_parallel"] == 1:
        return []
    rows = [("pipeline", f"{f['pipeline_parallel']} ranks x {f['pipeline_stages_per_rank']} stage(s), "
                         f"{f['pipeline_schedule']}, {f['pipeline_microbatches']} microbatches per micro-batch: "
                         f"bubble {f['bubble_share']:.1%} of a step")]
    for rank in f["stages"]:
        held = ", ".join(f"{s['stage']} ({s['units'][0]}" + (f" .. {s['units'][-1]})" if len(s["units"]) > 1 else ")")
                         for s in rank["stages"])
        in_flight = "+".join(str(s["microbatches_in_flight"]) for s in rank["stages"])
        rows.append((f"pipeline rank {rank['pipeline_rank']}",
                     f"stage {held}: state {sized(rank['state_bytes'])}, {in_flight} microbatch(es) in flight "
                     f"{sized(rank['activation_bytes_in_flight'])}, peak {sized(rank['memory_bytes'])}"))
    rows.append(("between stages / step", f"{sized(f['pipeline_bytes_per_step_intra_node'])} intra-node, "
                                          f"{sized(f['pipeline_bytes_per_step_inter_node'])} inter-node per rank "
                                          "(activations on, gradients back; in the collectives' figures)"))
    return rows
