"""The plan's bytes per collective per step, by mesh dimension and kind, against the bytes a real CPU run's process
groups carry (issue 51, item 2). One launch of 8 workers trains a tiny GPT (an MoE for expert parallel) for 2 steps
under several layouts in sequence (tests/helpers/train_runs.py); in each worker a dispatch mode counts every c10d
and functional collective of each step (FSDP2's all-gathers and reduce-scatters, DTensor's all-reduces, the
pipeline's sends, the experts' all-to-alls), by the group's place in the layout's mesh; `distrib plan --json` of the
same config says what it expects. Both are the bytes a rank sends, ring collectives counted alike (an all-reduce of N
bytes over g ranks: 2 (g-1)/g N; an all-gather or reduce-scatter: (g-1)/g N of the gathered size; an all-to-all: the
chunks for the others; a send: N). The step counted is the second (the first's lazy set-up is no step's traffic);
each row is the most any rank sent (a pipeline's stages differ), the all-to-alls' the ranks' mean (the plan counts
the routed rows balanced). Replica groups run under `distrib train` (its launcher starts the Lighthouse and the
groups), each worker counted through a sitecustomize module; torchft's group across them is no group of the world's.
Rows under 1 KiB (the loss's and the gradient norm's scalars, which the plan does not count) are not judged.

    python scripts/bench_traffic.py [--layouts fsdp,tp,pp,ep] [--nproc 8] [--json FILE]
Prints, per layout, the table: mesh dimension, kind, planned bytes, counted bytes, counted / planned; exits 1 when a
row is off by more than 10%. Measured on 2 CPU cores (5-6 min for the 11 layouts): every row within 1.000 +- 0.003
but ddp's buffer broadcast (1.040) and the experts' all-to-all (1.003)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = "/usr/share/common-licenses/GPL-3"
BASE = ["data.name=text", f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw", "train.max_steps=2",
        "train.global_batch_size=16", "train.epochs=0", "train.eval_every_epochs=0", "checkpoint.every_steps=0",
        "run.progress=false", "dist.device=cpu", "model.name=gpt", "train.log_every=100"]
GPT = "model.kwargs={n_layers = 4, n_heads = 4, dim = 64, tie_weights = false}"
MOE = "model.kwargs={n_layers = 2, n_heads = 4, dim = 64, n_experts = 8, top_k = 2, expert_hidden_dim = 64}"
# name: the overrides at world 8 (each as `distrib train` and `distrib plan` take them)
LAYOUTS = {
    "fsdp": [GPT, "dist.strategy=fsdp"],
    "hsdp": [GPT, "dist.strategy=hsdp", "dist.shard_size=4"],
    "ddp": [GPT, "dist.strategy=ddp"],
    "tp": [GPT, "dist.strategy=fsdp", "dist.tensor_parallel=2"],
    "pp": [GPT, "dist.strategy=fsdp", "dist.pipeline_parallel=2"],
    "pp_tp": [GPT, "dist.strategy=fsdp", "dist.pipeline_parallel=2", "dist.tensor_parallel=2"],
    "ep": [MOE, "dist.strategy=fsdp", "dist.expert_parallel=2"],
    "tp_checkpointed": [GPT, "dist.strategy=fsdp", "dist.tensor_parallel=2", "speed.activation_checkpointing=blocks"],
    "fsdp_accum": [GPT, "dist.strategy=fsdp", "train.grad_accum_steps=2", "dist.reshard_after_forward=false"],
    "pp_accum": [GPT, "dist.strategy=fsdp", "dist.pipeline_parallel=2", "train.grad_accum_steps=2"],
    "groups": [GPT, "dist.strategy=fsdp", "dist.fault_tolerant_groups=2"],
}
# launched by `distrib train` (its launcher starts the Lighthouse and the groups), each worker counted through a
# sitecustomize module that installs the counter; the others share one torchrun launch
OWN_LAUNCH = {"groups"}
SITE = f"""import os, sys
if os.environ.get("BENCH_TRAFFIC_OUT") and "RANK" in os.environ:
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import bench_traffic
    bench_traffic.install()
"""
WITHIN = 0.10  # counted / planned within 10%
CHECKED_STEP = 2  # the step counted: the first one's lazy set-up is not a step's traffic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--json", help="also write the rows there")
    args = parser.parse_args()
    names = args.layouts.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-traffic-") as folder:
        counted = count_runs(names, args.nproc, Path(folder))
        rows = {name: compare(planned(LAYOUTS[name], args.nproc, Path(folder)), counted[name]) for name in names}
    for name in names:
        print(table(name, rows[name]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.exit(0 if all(row["within"] for name in names for row in rows[name]) else 1)


def count_runs(names: list[str], nproc: int, folder: Path) -> dict[str, dict]:
    """{layout: {dimension|kind: bytes}} (counted_bytes), the layouts but OWN_LAUNCH's in one torchrun launch of
    nproc workers (tests/helpers/train_runs.py)."""
    shared = [name for name in names if name not in OWN_LAUNCH]
    runs = [[name, {"BENCH_TRAFFIC_OUT": str(folder / name)}, [*BASE, *LAYOUTS[name], f"run.dir={folder / name}"]]
            for name in shared]
    (folder / "runs.json").write_text(json.dumps(runs))
    if shared:
        _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                 str(Path(__file__).resolve()), "--worker", str(folder / "runs.json")], {})
    (folder / "site").mkdir(exist_ok=True)
    (folder / "site" / "sitecustomize.py").write_text(SITE)
    for name in names:
        if name in OWN_LAUNCH:
            sets = [item for each in [*BASE, *LAYOUTS[name], f"run.dir={folder / name}"] for item in ("--set", each)]
            _launch([sys.executable, "-m", "distrib", "train", "--nproc-per-node", str(nproc), *sets],
                    {"BENCH_TRAFFIC_OUT": str(folder / name), "PYTHONPATH": f"{folder / 'site'}:{REPO}"})
    return {name: counted_bytes(folder / name, nproc) for name in names}


def _launch(cmd: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    if done.returncode:
        sys.exit(f"the counted runs failed ({done.returncode}):\n{done.stderr[-4000:]}")


def counted_bytes(folder: Path, nproc: int) -> dict:
    """{dimension|kind: the bytes a rank sends at the counted step}: the most of any rank (the plan's figures are the
    fullest rank's: a pipeline's stages gather different bytes), but the all-to-alls' mean (the plan counts the
    experts' rows balanced; a step's routing is not)."""
    ranks = [json.loads(path.read_text()) for path in sorted(folder.glob("traffic_*.json"))]
    if len(ranks) != nproc:
        sys.exit(f"{folder.name}: {len(ranks)} ranks counted of {nproc}")
    keys = {key for counted in ranks for key in counted}
    return {key: (sum if key.endswith("|all-to-all") else max)(counted.get(key, 0.0) for counted in ranks)
            / (nproc if key.endswith("|all-to-all") else 1) for key in keys}


def planned(overrides: list[str], nproc: int, folder: Path) -> dict:
    """{dimension|kind: bytes} from `distrib plan --json` (intra- and inter-node summed: one node here)."""
    sets = [item for each in [*BASE, *overrides, f"run.dir={folder / 'plan'}"] for item in ("--set", each)]
    done = subprocess.run([sys.executable, "-m", "distrib", "plan", *sets, "--world-size", str(nproc), "--json"],
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"distrib plan failed ({done.returncode}):\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout)
    return {f"{c['dimension']}|{c['kind']}": c["intra_node"] + c["inter_node"] for c in figures["collectives"]}


def compare(plan: dict, counted: dict) -> list[dict]:
    """One row per (dimension, kind) either side has; `within`: counted / planned within WITHIN (both ~0 counts)."""
    rows = []
    for key in sorted({*plan, *counted}):
        mine, real = plan.get(key, 0.0), counted.get(key, 0.0)
        ratio = real / mine if mine else None
        small = max(mine, real) < 1024  # the loss's and the clip norm's all-reduces, which the plan does not count
        dimension, kind = key.split("|")
        rows.append({"dimension": dimension, "kind": kind, "planned": mine, "counted": real, "ratio": ratio,
                     "within": small or (ratio is not None and abs(ratio - 1) <= WITHIN)})
    return rows


def table(name: str, rows: list[dict]) -> str:
    lines = [f"== {name} ==", f"{'dimension':<22} {'kind':<15} {'planned':>12} {'counted':>12} {'ratio':>7}"]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        lines.append(f"{row['dimension']:<22} {row['kind']:<15} {row['planned']:>12.0f} {row['counted']:>12.0f} "
                     f"{ratio:>7}{'' if row['within'] else '  OFF'}")
    return "\n".join(lines)


# ---------------------------------------------------------------- in each worker

# c10d's ops (dist.* on a ProcessGroup: FSDP2's, the pipeline's, DDP's) and the functional ones (DTensor's, the
# experts'): (kind, the arguments' index of the process group or its name, how the payload's bytes are read)
def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(_nbytes(t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size() for t in tensors)


C10D = {"allreduce_": ("all-reduce", 1, 0), "allreduce_coalesced_": ("all-reduce", 1, 0),
        "_allgather_base_": ("all-gather", 2, 0), "allgather_": ("all-gather", 2, 0),
        "allgather_into_tensor_coalesced_": ("all-gather", 2, 0), "_reduce_scatter_base_": ("reduce-scatter", 2, 1),
        "reduce_scatter_": ("reduce-scatter", 2, 1), "reduce_scatter_tensor_coalesced_": ("reduce-scatter", 2, 1),
        "alltoall_base_": ("all-to-all", 2, 1), "alltoall_": ("all-to-all", 2, 1), "send": ("send", 1, 0),
        "broadcast_": ("broadcast", 1, 0)}
FUNCTIONAL = {"all_reduce": ("all-reduce", 2, 0), "all_reduce_": ("all-reduce", 2, 0),
              "all_reduce_coalesced": ("all-reduce", 2, 0), "all_gather_into_tensor": ("all-gather", 2, 0),
              "all_gather_into_tensor_coalesced": ("all-gather", 2, 0),
              "reduce_scatter_tensor": ("reduce-scatter", 3, 0),
              "reduce_scatter_tensor_coalesced": ("reduce-scatter", 3, 0), "all_to_all_single": ("all-to-all", 3, 0),
              "broadcast": ("broadcast", 2, 0)}


def _own_chunk(tensor, splits, group) -> float:
    """The bytes of an all-to-all's input that stay on this rank: its own split (equal ones when none given)."""
    import torch.distributed as dist

    size, me = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(tensor, (list, tuple)):  # one input tensor per rank
        return _nbytes(tensor[me])
    nbytes = tensor.numel() * tensor.element_size()
    if not splits:
        return nbytes / size
    return nbytes * splits[me] / max(1, sum(splits))


def sent_bytes(kind: str, payload: float, size: int) -> float:
    """The bytes one rank sends in a ring collective of `payload` bytes (an all-gather's: the gathered size) over
    `size` ranks, as distrib.plan counts them (group_split): an all-to-all's payload is its chunks for the others."""
    share = (size - 1) / size
    return {"all-reduce": 2 * share * payload, "all-gather": share * payload, "reduce-scatter": share * payload,
            "all-to-all": payload, "send": payload, "broadcast": payload}[kind]


def mesh_dimension(ranks: list[int], mesh: tuple[tuple[str, int], ...], world: int) -> str:
    """The name of the mesh dimension(s) a group of global ranks spans (ranks numbered row-major over the mesh,
    outermost first): 'shard', 'tp', 'replicate+shard' for a flattened pair; 'world' or 'ranks ...' otherwise."""
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    names, sizes = [name for name, _ in mesh], [size for _, size in mesh]
    for last in range(len(mesh)):
        inner = 1
        for size in sizes[last + 1:]:
            inner *= size
        if inner != stride:
            continue
        span = 1
        for first in range(last, -1, -1):
            span *= sizes[first]
            if span == len(ranks):
                return "+".join(names[first:last + 1])
    return "world" if len(ranks) == world else f"ranks {ranks[0]}..{ranks[-1]} by {stride}"


class CommCounter:
    """Counts, while entered, the bytes this rank sends in each collective on each process group, by the mesh
    dimension the group spans and the collective's kind: a dispatch mode that sees every c10d and functional
    collective op (the ops a collective inside one runs are not seen again)."""

    def __init__(self, dims):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.seen(func, args)
                return func(*args, **(kwargs or {}))

        self.mode, self.mesh, self.world = Mode(), dims.dims(), dims.world_size
        self.bytes: dict = defaultdict(float)
        self.ops: list[str] = []

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def seen(self, func, args) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        namespace, name = func._schema.name.split("::")
        table = C10D if namespace == "c10d" else FUNCTIONAL if namespace == "_c10d_functional" else {}
        if name not in table:
            return
        kind, at, tensors = table[name]
        group = dist.ProcessGroup.unbox(args[at]) if namespace == "c10d" else _resolve_process_group(args[at])
        try:
            ranks = dist.get_process_group_ranks(group)
        except KeyError:  # not a group of this world's: torchft's across the replica groups
            ranks = None
        payload = _nbytes(args[tensors])
        if kind == "all-to-all":  # the chunks for the others: its input's rows less its own split
            payload -= _own_chunk(args[tensors], args[at + (2 if namespace == "c10d" else -1)], group)
        key = f"{mesh_dimension(ranks, self.mesh, self.world) if ranks else 'groups'}|{kind}"
        self.bytes[key] += sent_bytes(kind, payload, len(ranks) if ranks else group.size())
        if os.environ.get("BENCH_TRAFFIC_OPS"):  # each op's shapes, to see what a formula misses
            shapes = [tuple(t.shape) for t in args if hasattr(t, "shape")] or \
                [tuple(t.shape) for a in args if isinstance(a, (list, tuple)) for t in a if hasattr(t, "shape")]
            self.ops.append(f"{key} {name} {shapes}")

    def by_dimension(self) -> dict:
        return dict(self.bytes)



def worker(runs_path: str) -> int:
    """train_runs.py's runs, each counted (install)."""
    from tests.helpers import train_runs

    install()
    return train_runs.main(runs_path)


def install() -> None:
    """Each run's CHECKED_STEP counted by a CommCounter into $BENCH_TRAFFIC_OUT/traffic_RANK_PID.json (and each op
    into ops_RANK_PID.txt)."""
    from distrib.training.trainer import Trainer

    original = Trainer._try_step

    def counted_step(self, micro_batches):
        if self.state.progress.step + 1 != CHECKED_STEP:
            return original(self, micro_batches)
        counter = CommCounter(self.state.strategy.dims)
        with counter:
            loss = original(self, micro_batches)
        folder = Path(os.environ["BENCH_TRAFFIC_OUT"])
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{os.environ['RANK']}_{os.getpid()}"  # replica groups: ranks 0.. of each group
        (folder / f"traffic_{name}.json").write_text(json.dumps(counter.by_dimension()))
        (folder / f"ops_{name}.txt").write_text("\n".join(counter.ops))
        return loss

    Trainer._try_step = counted_step


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        from distrib import cli

        cli.hard_exit(worker(sys.argv[2]))
    main()
