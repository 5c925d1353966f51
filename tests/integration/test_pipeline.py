"""Pipeline parallel (gloo, CPU) against one process, on the built-in GPT (4 blocks, dim 64, seq 32, untied) after 6
AdamW steps with gradient clipping: pp 2 x fsdp 2 with 1f1b and with interleaved_1f1b (2 stages per rank) at world
size 4 and pp 2 alone (ddp, gpipe) at world size 2 end within 1e-5 of it and evaluate the same test set exactly (pp 2 x
tp 2 x fsdp 2 at world size 8: the Llama's below; pp 2 x cp 2 x fsdp 2 at world size 8: a GPT and a transformers
Llama at sequence 256, 12 steps, resumed bitwise, and in one process; packed documents under pp 2 x fsdp 2: the GPT and
the Llama). The pp 2 x fsdp 2 checkpoint of step 3 resumes within 1e-5 of one
process as fsdp at world size 2 and as ddp in one process. A user's nn.Sequential split by
dist.pipeline_split trains like one process, with a validation set, EMA weights and early stopping; without a split it
is one line, exit 2. distrib plan gives a pipeline run's state exactly and its bubble, and each pipeline rank's peak
within 50% (its arithmetic: tests/unit/test_plan.py). (The pipeline's split and views: tests/unit/test_pipeline.py; a pp
layout in the resume matrix: test_resume_matrix.py.)

A transformers Llama (tests/helpers/pretrained.py's sizes) from a local safetensors folder (model.init_from) is cut by
its own pipeline plan: pp 2 x fsdp 2 (world 4) and pp 2 x tp 2 x fsdp 2 (world 8), and by its own tensor-parallel
plan at tp 2 x fsdp 2 (world 4), train within 1e-5 of one process; the pp 2 x fsdp 2 run resumes bitwise, and the
world-8 run's weights/ load with from_pretrained and give one process's logits; distrib eval and generate read it.
A transformers Qwen2 by its own tensor-parallel plan (every style of it) at tp 2 x fsdp 2 (world 4) trains like one
process, in the same launch: its workers import transformers once."""

import json
from pathlib import Path

import pytest
import torch

from distrib import cli
from distrib.checkpoint.weights import read_weights
from distrib.config import load_config
from distrib.models.gpt import GPT as GPT_MODEL
from distrib.plan import Machine, plan_run
from distrib.training.generate import generate_text, sample
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs, split_runs, torchrun_runs
from tests.helpers.pretrained import save_llama, save_qwen2
from tests.helpers.support import VALIDATED, assert_ok, load_weights, max_relative_diff

TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it: 35 kB of English prose
GPT = ["model.name=gpt", "model.kwargs={n_layers = 4, n_heads = 4, dim = 64, tie_weights = false}",
       "data.name=text", f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw", "train.lr=3e-3",
       "train.warmup_steps=3", "train.max_steps=6", "train.global_batch_size=16", "train.epochs=0",
       "train.eval_every_epochs=0", "checkpoint.every_steps=0", "train.grad_clip=0.5", "run.progress=false",
       "dist.device=cpu"]
SAVE_3 = "checkpoint.every_steps=3"  # in the GPT's runs that others resume from step 3 (the Llama's: step 6 of 12)
PP = ["dist.strategy=fsdp", "dist.pipeline_parallel=2"]
INTERLEAVED = [*GPT, *PP, "dist.pipeline_schedule=interleaved_1f1b"]
# the Llama's model.init_from (the folder) is added by the fixture; its vocabulary is the text's 256 bytes; 12 AdamW
# steps, as the Hugging Face promise is stated (the GPT's 6 show the same layouts)
LLAMA = [*GPT[2:], "data.seq_len=16", "model.factory=tests.helpers.pretrained:llama", "train.max_steps=12"]
# A user's nn.Sequential (Flatten, Linear, ReLU, Linear) with a validation set, EMA weights and early stopping (after
# the evaluation of step 9: tests/helpers/support.py's VALIDATED).
SEQUENTIAL = ["data.name=synthetic", *VALIDATED, "train.global_batch_size=32", "train.warmup_steps=2",
              "model.factory=tests.helpers.factories:wide_mlp", "model.kwargs={width = 64}", "train.ema_decay=0.9",
              "train.grad_clip=0.5", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=0"]
SPLIT = ["dist.pipeline_parallel=2", 'dist.pipeline_split=["2"]']
# transformers' Qwen2 with its own plan as is (embed_tokens embedding_rowwise, lm_head colwise_gather_output, q/k/v
# with biases colwise), on dict samples: its own base, not the GPT's; model.init_from is added by the fixture.
QWEN2 = ["data.factory=tests.helpers.pretrained:token_dicts", "model.factory=tests.helpers.pretrained:qwen2",
         "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=2", "train.max_steps=12", "train.epochs=0",
         "train.global_batch_size=16", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=0"]
# distrib plan against pp 2 x fsdp 2 runs of 2 steps, first in the launch of 4 workers (tests/helpers/train_runs.py
# writes each rank's peak resident memory so far after each run): a tiny GPT, the baseline of the peaks, then a
# 25.9M-parameter one (103 MB in fp32, untied: a pipeline splits the embedding from the output layer).
PLANNED = ["model.name=gpt", "data.name=text", f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw",
           "train.global_batch_size=16", "train.max_steps=2", "train.epochs=0", "train.eval_every_epochs=0",
           "run.progress=false", "dist.device=cpu", *PP]
# Context parallel beside the pipeline at the size: the built-in GPT at sequence 256, 12 AdamW steps, each
# stage's blocks attending over the cp ranks' keys (the step's inputs: distrib.distributed.step_inputs)
CP_GPT = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 32, tie_weights = false}",
          "data.name=text", f"data.root={TEXT}", "data.seq_len=256", "train.optimizer=adamw", "train.lr=3e-3",
          "train.warmup_steps=3", "train.max_steps=12", "train.global_batch_size=4", "train.epochs=0",
          "train.eval_every_epochs=0", "checkpoint.every_steps=6", "run.progress=false", "dist.device=cpu"]
PP_CP = [*CP_GPT, *PP, "dist.context_parallel=2"]
# and a transformers Llama (GQA), its stages' layers attending through transformers' attention interface
CP_LLAMA = [*CP_GPT[2:], "model.factory=tests.helpers.pretrained:llama", "model.kwargs={max_position_embeddings = 256}"]
PP_CP_LLAMA = [*CP_LLAMA, *PP, "dist.context_parallel=2"]
# Packed documents (a document ends at each '.', byte 46) under pp 2 x fsdp 2: the stages take the step's positions
PACKED = ["data.document_mask=true", "data.eos_id=46", "data.seq_len=64"]
PACKED_GPT = [*GPT, *PACKED]
PACKED_LLAMA = [*LLAMA, *PACKED, "model.kwargs={max_position_embeddings = 64}"]
PLANNED_RUNS = {"plan_tiny": [*PLANNED, "model.kwargs={n_layers = 4, n_heads = 4, dim = 32, tie_weights = false}"],
                "plan_medium": [*PLANNED, "model.kwargs={n_layers = 8, n_heads = 8, dim = 512, tie_weights = false}"]}


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _resume_from(run_dir: Path, step: int = 3) -> str:
    return f"checkpoint.resume={run_dir / 'checkpoints' / f'step_{step:08d}'}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Every run: the one-process references here, then launches of 4, 8 and 2 workers (several runs each, sharing
    the workers' start-up), then the pp checkpoint resumed in one process. Returns the folder and each launched
    run's part of rank 0's stderr."""
    tmp = tmp_path_factory.mktemp("pp")
    llama = [*LLAMA, f"model.init_from={save_llama(tmp / 'llama')}"]
    qwen2 = [*QWEN2, f"model.init_from={save_qwen2(tmp / 'qwen2')}"]
    run_training(load_config(None, [*GPT, f"run.dir={tmp / 'one'}"]))
    run_training(load_config(None, [*llama, f"run.dir={tmp / 'hf_one'}"]))
    run_training(load_config(None, [*LLAMA, f"run.dir={tmp / 'hf_plain_one'}"]))  # transformers' own initialisation
    run_training(load_config(None, [*SEQUENTIAL, f"run.dir={tmp / 'seq_one'}"]))
    logs = {}
    launches = {
        4: {**PLANNED_RUNS, "pp_1f1b": [*GPT, *PP, SAVE_3], "pp_interleaved": INTERLEAVED,
            "hf_tp_fsdp": [*llama, "dist.strategy=fsdp", "dist.tensor_parallel=2"],
            "hf_pp": [*llama, *PP, "checkpoint.every_steps=6"],
            "hf_pp_resumed": [*llama, *PP, _resume_from(tmp / "hf_pp", 6)], "hf_plain_pp": [*LLAMA, *PP],
            "qwen2_tp": [*qwen2, "dist.strategy=fsdp", "dist.tensor_parallel=2"],
            "pp_packed": [*PACKED_GPT, *PP], "hf_pp_packed": [*PACKED_LLAMA, *PP]},
        8: {"hf_pp_tp_fsdp": [*llama, *PP, "dist.tensor_parallel=2"], "pp_cp_fsdp": PP_CP,
            "pp_cp_resumed": [*PP_CP, _resume_from(tmp / "pp_cp_fsdp", 6)], "hf_pp_cp_fsdp": PP_CP_LLAMA,
            "hf_pp_cp_resumed": [*PP_CP_LLAMA, _resume_from(tmp / "hf_pp_cp_fsdp", 6)]}}
    for nproc, named in launches.items():
        (tmp / f"launch{nproc}").mkdir()
        done = torchrun_runs(nproc, {name: [*items, f"run.dir={tmp / name}"] for name, items in named.items()},
                             tmp / f"launch{nproc}", env={"TRAIN_RUNS_PEAKS": str(tmp / f"launch{nproc}")})
        assert_ok(done)
        logs.update(split_runs(done.stderr, list(named)))
    # at world size 2: the GPT's, then the user's Sequential and the refusals, in one launch that runs them all and
    # keeps their exit codes
    gpt = {"gpipe": ["dist.strategy=ddp", "dist.pipeline_parallel=2", "dist.pipeline_schedule=gpipe"],
           "fsdp_from_pp": ["dist.strategy=fsdp", _resume_from(tmp / "pp_1f1b")]}
    sequential = {"seq_pp": SPLIT, "seq_no_split": ["dist.pipeline_parallel=2"],
                  "seq_bad_split": [*SPLIT[:1], 'dist.pipeline_split=["4"]']}
    codes = tmp / "codes.json"
    done = launch_runs([*torchrun(2)], [*[(name, {}, [*GPT, f"run.dir={tmp / name}", *items])
                                          for name, items in gpt.items()],
                                        *[(name, {}, [*SEQUENTIAL, f"run.dir={tmp / name}", *items])
                                          for name, items in sequential.items()]], tmp, codes=codes)
    assert done.returncode == 0, done.stderr[-3000:]
    logs.update(split_runs(done.stderr, [*gpt, *sequential]))
    logs["codes"] = json.loads(codes.read_text())
    assert logs["codes"]["gpipe"] == logs["codes"]["fsdp_from_pp"] == 0, logs["codes"]
    run_training(load_config(None, [*GPT, f"run.dir={tmp / 'ddp_from_pp'}", _resume_from(tmp / "pp_1f1b")]))
    return tmp, logs


def torchrun(nproc: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["pp_1f1b", "pp_interleaved", "gpipe"])
def test_each_pipeline_layout_trains_and_evaluates_like_one_process(runs, name):
    tmp, logs = runs
    one, run = _summary(tmp / "one"), _summary(tmp / name)
    assert max_relative_diff(load_weights(tmp / name), load_weights(tmp / "one")) < 1e-5
    assert run["test_count"] == one["test_count"] > 0  # every test window once, not once per stage
    assert run["test_loss"] == pytest.approx(one["test_loss"], rel=1e-6)
    assert run["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    assert run["flops_per_sample"] == one["flops_per_sample"] == _summary(tmp / "fsdp_from_pp")["flops_per_sample"]
    assert "no rank held the model whole" in logs[name]


@pytest.mark.timeout(900)
def test_each_rank_holds_only_its_stages(runs):
    tmp, logs = runs
    assert "this rank holds stage 0 (tok_embeddings .. layers.1)" in logs["pp_1f1b"]
    assert "this rank holds stage 0 (tok_embeddings .. layers.0), stage 2 (layers.2)" in logs["pp_interleaved"]
    whole, pp = _summary(tmp / "fsdp_from_pp")["state_bytes_per_rank"], _summary(tmp / "pp_1f1b")
    assert pp["state_bytes_per_rank"] < 0.6 * whole  # fsdp 2 vs pp 2 x fsdp 2: about half, the larger stage's


@pytest.mark.timeout(900)
# (P - 1) / (M + P - 1), M = 2 stages' microbatches; interleaved (P - 1) / (V M + P - 1), V = 2, M = 4
@pytest.mark.parametrize("name, items, bubble", [("plan_tiny", PLANNED_RUNS["plan_tiny"], 1 / 3),
                                                 ("pp_interleaved", INTERLEAVED, 1 / 9)])
def test_plan_gives_a_pipeline_runs_state_exactly_and_its_bubble(runs, capsys, name, items, bubble):
    tmp, _ = runs
    assert cli.main(["plan", *[a for s in items for a in ("--set", s)], "--world-size", "4", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["state_bytes_per_rank"] == _summary(tmp / name)["state_bytes_per_rank"]
    assert figures["bubble_share"] == pytest.approx(bubble)


@pytest.mark.timeout(900)
def test_plan_tells_each_pipeline_ranks_peak(runs, monkeypatch):
    """The 25.9M GPT's peak above the tiny one's, on each rank but rank 0 (which also gathers the whole model for
    model.pt at the end), within 50% of what plan says its pipeline rank holds: its state, its stage's parameters
    gathered and gradients unsharded through the step, its activations in flight (about 2x the state's 99 MiB)."""
    tmp, _ = runs
    monkeypatch.setenv("DISTRIB_HOST_ALLOCATOR", "glibc")  # torchrun's workers: glibc with distrib's thresholds
    planned = {name: plan_run(load_config(None, PLANNED_RUNS[name]), Machine(1, 4))["stages"] for name in PLANNED_RUNS}
    peaks = [json.loads((tmp / "launch4" / f"peaks_{rank}.json").read_text()) for rank in range(4)]
    for rank in (1, 2, 3):
        pipeline_rank = rank // 2  # pp is the outermost dimension
        measured = peaks[rank]["plan_medium"] - peaks[rank]["plan_tiny"]
        expected = (planned["plan_medium"][pipeline_rank]["memory_bytes"]
                    - planned["plan_tiny"][pipeline_rank]["memory_bytes"])
        print(f"rank {rank}: measured {measured / 2**20:.1f} MiB, plan {expected / 2**20:.1f} MiB")
        assert abs(measured - expected) <= 0.5 * measured, (rank, measured, expected)


@pytest.mark.timeout(900)
def test_a_pipeline_checkpoint_reshards_to_fsdp_and_ddp(runs):
    """(Resumed under its own layout, bitwise: the Llama's pp run below.)"""
    tmp, _ = runs
    one = load_weights(tmp / "one")
    for name in ("fsdp_from_pp", "ddp_from_pp"):
        assert _summary(tmp / name)["resumed_from_step"] == 3
        assert max_relative_diff(load_weights(tmp / name), one) < 1e-5, name


@pytest.mark.timeout(900)
def test_the_weights_files_carry_one_process_names_and_eval_and_generate_read_them(runs):
    tmp, _ = runs
    exported, one = read_weights(tmp / "pp_1f1b" / "weights"), read_weights(tmp / "one" / "weights")
    assert list(exported) == list(one)
    assert all(torch.equal(exported[name], tensor) for name, tensor in load_weights(tmp / "pp_1f1b").items())
    assert cli.main(["eval", str(tmp / "pp_1f1b")]) == 0  # in one process, from the pp run's model.pt
    evaluated = json.loads((tmp / "pp_1f1b" / "eval.json").read_text())
    assert evaluated["test_loss"] == pytest.approx(_summary(tmp / "pp_1f1b")["test_loss"], rel=1e-6)
    # distrib generate, in one process from the pp run's config, against the GPT built here on model.pt's weights
    reference = GPT_MODEL(vocab_size=256, seq_len=32, n_layers=4, n_heads=4, dim=64, tie_weights=False)
    reference.load_state_dict(load_weights(tmp / "pp_1f1b"))
    greedy = sample(reference.eval(), list(b"The "), 12, temperature=0, seq_len=32)
    assert generate_text(str(tmp / "pp_1f1b"), "The ", 12, temperature=0) == bytes(greedy).decode("utf-8", "replace")


@pytest.mark.timeout(900)
def test_a_split_sequential_trains_like_one_process_with_validation_ema_and_early_stopping(runs):
    tmp, logs = runs
    assert logs["codes"]["seq_pp"] == 0
    one, run = _summary(tmp / "seq_one"), _summary(tmp / "seq_pp")
    assert run["steps"] == one["steps"] == 9 and run["stop_reason"] == "early_stop"
    for key in ("test_loss", "test_accuracy", "test_loss_ema", "val_loss"):
        if key in one:
            assert run[key] == pytest.approx(one[key], rel=1e-6), key
    assert max_relative_diff(load_weights(tmp / "seq_pp"), load_weights(tmp / "seq_one")) < 1e-5
    assert run["flops_per_sample"] == one["flops_per_sample"] > 0  # counted on the whole model, not one stage
    ema = torch.load(tmp / "seq_pp" / "model_ema.pt", weights_only=True)
    assert max_relative_diff(ema, torch.load(tmp / "seq_one" / "model_ema.pt", weights_only=True)) < 1e-5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, says", [
    ("seq_no_split", "has no pipeline split of its own; name the modules that start stages 2, 3, ... with --set "
                     "'dist.pipeline_split=[...]' (its units: 0, 1, 2, 3)"),
    ("seq_bad_split", "'4' is not one of Sequential's pipeline units (0, 1, 2, 3)")])
def test_a_sequential_without_a_usable_split_is_one_line(runs, name, says):
    _, logs = runs
    assert logs["codes"][name] == 2
    # every rank says it (a neighbouring run's rank 1 may still be saying its own when rank 0 starts this one)
    errors = [line for line in logs[name].splitlines() if line.startswith("distrib: error:")]
    assert any(says in line for line in errors) and "Traceback" not in logs[name]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["hf_pp", "hf_pp_tp_fsdp", "hf_tp_fsdp"])
def test_a_hugging_face_llama_from_its_folder_trains_under_every_layout_like_one_process(runs, name):
    tmp, logs = runs
    one, run = _summary(tmp / "hf_one"), _summary(tmp / name)
    assert max_relative_diff(load_weights(tmp / name), load_weights(tmp / "hf_one")) < 1e-5
    assert run["test_count"] == one["test_count"] > 0
    assert run["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    if name != "hf_tp_fsdp":
        assert "this rank holds stage 0 (model.embed_tokens .. model.layers.0)" in logs[name]
    assert "model.init_from" in logs[name] and "no rank held the model whole" in logs[name]
    # (and not FSDP2's warning that a unit returned a view, which tensor parallel's outputs no longer are)
    assert "view tensor" not in logs[name] and "Traceback" not in logs[name]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, items, plain", [("pp_cp", CP_GPT, []), ("hf_pp_cp", CP_LLAMA, ["dist.strategy=fsdp"])])
def test_pp2_cp2_fsdp2_trains_like_one_process_and_resumes_bitwise_and_in_one_process(runs, tmp_path, name, items,
                                                                                      plain):
    """pp 2 x cp 2 x fsdp 2 (world 8): the stages pass the activations of this rank's two chunks of every window, and
    each stage's blocks take the step's global positions and gathered attention (a transformers Llama's stages: through
    its attention interface); evaluation sees whole windows. Measured: weights 7.4e-7 (the GPT) and 2.3e-6 (the Llama)
    off one process, the logged loss and the test loss within 1e-8; its checkpoint of step 6 resumes bitwise under the
    same layout, and in one process (the Llama's as plain fsdp)."""
    tmp, logs = runs
    one = run_training(load_config(None, [*items, f"run.dir={tmp_path}/one"]))
    run = _summary(tmp / f"{name}_fsdp")
    went_on = load_weights(tmp / f"{name}_fsdp")
    assert run["world_size"] == 8 and run["steps"] == one["steps"] == 12
    assert "fsdp: pp 2 x shard 2 x cp 2" in logs[f"{name}_fsdp"], logs[f"{name}_fsdp"][-3000:]
    assert max_relative_diff(went_on, load_weights(tmp_path / "one")) < 1e-5
    assert run["test_count"] == one["test_count"] > 0  # every test window once, whole
    assert run["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    assert run["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    resumed = load_weights(tmp / f"{name}_resumed")
    assert _summary(tmp / f"{name}_resumed")["resumed_from_step"] == 6
    assert all(torch.equal(resumed[key], went_on[key]) for key in went_on)
    run_training(load_config(None, [*items, *plain, f"run.dir={tmp_path}/plain",
                                    _resume_from(tmp / f"{name}_fsdp", 6)]))
    assert _summary(tmp_path / "plain")["resumed_from_step"] == 6
    assert max_relative_diff(load_weights(tmp_path / "plain"), went_on) < 1e-6


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, items", [("pp_packed", PACKED_GPT), ("hf_pp_packed", PACKED_LLAMA)])
def test_packed_documents_under_pp2_fsdp2_train_and_evaluate_like_one_process(runs, tmp_path, name, items):
    """Each stage masks by the documents of the step's positions (each microbatch's rows), as the whole model does in
    one process (whose packed windows equal each document alone: tests/unit/test_packed_documents.py; the stages'
    logits of three documents as alone: tests/unit/test_context_parallel.py)."""
    tmp, logs = runs
    one = run_training(load_config(None, [*items, f"run.dir={tmp_path}/one"]))
    run = _summary(tmp / name)
    assert "packed documents" in logs[name] and "this rank holds stage 0" in logs[name]
    assert run["steps"] == one["steps"] > 0
    assert max_relative_diff(load_weights(tmp / name), load_weights(tmp_path / "one")) < 1e-5
    assert run["test_count"] == one["test_count"] > 0
    assert run["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    assert run["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)


@pytest.mark.timeout(900)
def test_a_hugging_face_llama_initialised_by_rank_0_trains_under_pipeline_parallel_like_one_process(runs):
    """transformers' class as is (no init_from, no initialisation of its own shards): rank 0 builds it whole and each
    stage's ranks keep their own tensors of it."""
    tmp, logs = runs
    assert max_relative_diff(load_weights(tmp / "hf_plain_pp"), load_weights(tmp / "hf_plain_one")) < 1e-5
    assert "rank 0 built it whole once in host memory" in logs["hf_plain_pp"]


@pytest.mark.timeout(900)
def test_a_hugging_face_pipeline_run_resumes_bitwise(runs):
    tmp, _ = runs
    uninterrupted, resumed = load_weights(tmp / "hf_pp"), load_weights(tmp / "hf_pp_resumed")
    assert _summary(tmp / "hf_pp_resumed")["resumed_from_step"] == 6
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


@pytest.mark.timeout(900)
def test_a_hugging_face_pipeline_runs_weights_load_with_from_pretrained_and_give_one_process_logits(runs):
    from transformers import LlamaForCausalLM

    tmp, _ = runs
    folder = tmp / "hf_pp_tp_fsdp" / "weights"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    assert all(torch.equal(loaded.state_dict()[name], tensor)
               for name, tensor in load_weights(tmp / "hf_pp_tp_fsdp").items())
    one = LlamaForCausalLM.from_pretrained(tmp / "hf_one" / "weights").eval()
    tokens = torch.tensor([list(b"The licenses for most software")[:16]])
    with torch.no_grad():
        logits, reference = loaded(tokens).logits, one(tokens).logits
    assert ((logits - reference).norm() / reference.norm()).item() < 1e-5
    assert cli.main(["eval", str(tmp / "hf_pp_tp_fsdp")]) == 0  # distrib eval and generate read it in one process
    evaluated = json.loads((tmp / "hf_pp_tp_fsdp" / "eval.json").read_text())
    assert evaluated["test_loss"] == pytest.approx(_summary(tmp / "hf_pp_tp_fsdp")["test_loss"], rel=1e-6)
    greedy = sample(loaded, list(b"The "), 8, temperature=0, seq_len=16)
    assert generate_text(str(tmp / "hf_pp_tp_fsdp"), "The ", 8, temperature=0) == bytes(greedy).decode("utf-8",
                                                                                                      "replace")


@pytest.mark.timeout(900)
def test_a_qwen2_with_transformers_own_plan_trains_like_one_process(tmp_path, runs):
    """tp 2 x fsdp 2 with every style of Qwen2's plan against one process, after 6 AdamW steps: every tensor within
    float noise but the key bias, whose true gradient is 0 (softmax ignores a shift shared by every key): AdamW turns
    its float noise into full steps. Measured (at 12 steps): 1.9e-6 on the rest, 2.9e-5 and 1.8e-5 on the two key
    biases; the run itself 18 s of the launch."""
    from safetensors.torch import load_file

    folder, _ = runs
    one = run_training(load_config(None, [*QWEN2, f"run.dir={tmp_path}/one", f"model.init_from={folder}/qwen2"]))
    tp = json.loads((folder / "qwen2_tp" / "summary.json").read_text())
    assert tp["world_size"] == 4 and tp["steps"] == one["steps"] == 12
    weights, reference = load_weights(folder / "qwen2_tp"), load_weights(tmp_path / "one")
    initial = load_file(folder / "qwen2" / "model.safetensors")
    assert max_relative_diff(initial, reference) > 1e-2  # 6 steps moved the weights
    rest = [name for name in reference if not name.endswith("k_proj.bias")]
    assert len(rest) == len(reference) - 2  # two layers' key biases
    assert max_relative_diff({k: weights[k] for k in rest}, {k: reference[k] for k in rest}) < 1e-5
    keys = [name for name in reference if name not in rest]
    assert max_relative_diff({k: weights[k] for k in keys}, {k: reference[k] for k in keys}) < 1e-3
