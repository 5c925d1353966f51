"""The dry run's lines under the plan's table (distrib.plan.dry_run): its measured peak beside the plan's, the parts
at the peak, each measured rank's, its verdict and fixes, how it was measured."""

from __future__ import annotations

from distrib.plan.report import fix_rows, sized

PART_WORDS = {"parameters": "parameters", "unsharded_parameters": "gathered parameters", "gradients": "gradients",
              "optimizer": "optimizer state", "activations": "activations", "all_gather": "all-gather buffers",
              "reduce_scatter": "reduce-scatter buffers", "temporaries": "temporaries", "ddp_buckets": "DDP buckets"}


def rows(figures: dict) -> list[tuple[str, str]]:
    """The dry run's lines under the plan's table: the measured peak beside the plan's, its parts, each rank's, its
    verdict and fixes (as the plan's), how it was measured."""
    f = figures
    measured = ", ".join(f"rank {r['rank']} (pipeline rank {r['pipeline_rank']}) {sized(r['peak_bytes'])}"
                         for r in f["dry_run_ranks"])
    parts = ", ".join(f"{words} {sized(f[f'dry_run_{part}_bytes'])}" for part, words in PART_WORDS.items()
                      if f[f"dry_run_{part}_bytes"])
    counted, slack = f["dry_run_ranks"][0].get("measured_blocks"), f["allocator_slack_bytes_per_rank"]
    how = f"{f['dry_run_attention']} attention" + (
        f", {counted[0]} and {counted[1]} blocks stepped and the rank's {f['dry_run_ranks'][0]['blocks']} counted"
        if counted else "")
    return [("dry run peak / rank", f"{sized(f['dry_run_peak_bytes_per_rank'])} measured on fake tensors (rank "
                                    f"{f['dry_run_rank']}), plan {sized(f['memory_bytes_per_rank'] - slack)} "
                                    f"(without its allocator slack, {sized(slack)})"),
            ("dry run parts at the peak", parts),
            *([("dry run ranks", measured)] if len(f["dry_run_ranks"]) > 1 else []),
            *_verdict_rows(f),
            ("dry run", f"the layout built on a fake group of {f['dry_run_world_size']} ranks and one step run in "
                        f"{f['dry_run_seconds']:.1f} s ({how})")]


def _verdict_rows(f: dict) -> list[tuple[str, str]]:
    if "dry_run_fits" not in f:
        return []
    row = (f"{'fits' if f['dry_run_fits'] else 'DOES NOT FIT'}: {sized(f['dry_run_memory_bytes_per_rank'])} of "
           f"{sized(f['device_memory_bytes'])} (the measured peak" + (
               f", the block prefetched {sized(f['dry_run_prefetched_bytes'])}" if f["dry_run_prefetched_bytes"]
               else "") + f", allocator slack {sized(f['dry_run_allocator_slack_bytes'])})")
    fixes = fix_rows({"fits": f["dry_run_fits"], "fixes": f["dry_run_fixes"]})
    return [("dry run device memory", row), *((f"dry run {name}" if name else "", text) for name, text in fixes)]
