"""Weights in and out, in one process: the safetensors layout and byte runs of split blocks, a model saved in several
files and read back by from_pretrained, what a rank of a sharded model reads (a fake process group: rank 1 of fsdp 2,
rank 3 of tensor parallel 2 x fsdp 2), the strict check of names and shapes with the Hugging Face conventions, and
each kind of source (safetensors, model.pt, a one-file checkpoint, a sharded one)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn as nn

from distrib.checkpoint.format import FORMAT
from distrib.checkpoint.init_from import check_weights, load_weights, open_source
from distrib.checkpoint.pretrained_sources import Safetensors, TorchFile, read_plan
from distrib.checkpoint.weight_files import INDEX
from distrib.checkpoint.weights import (
    byte_runs,
    hf_config,
    layout,
    model_tensors,
    read_weights,
    save_weights,
)
from distrib.errors import UserError
from tests.helpers.pretrained import damaged_weights, llama, save_llama
from tests.helpers.support import fake_rank


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_byte_runs_put_every_block_of_a_split_tensor_in_its_place():
    """Blocks of rows (fsdp), of columns (tensor parallel's row-wise layers) and both, written through byte_runs into
    one buffer, give the whole tensor's bytes."""
    whole = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 6, 3)
    for row_parts, column_parts in ((2, 1), (1, 3), (2, 3), (4, 2)):
        buffer = bytearray(whole.numel() * 4)
        for rows in whole.tensor_split(row_parts, 0):
            for block in rows.tensor_split(column_parts, 1):
                offsets = (block.data_ptr() - whole.data_ptr()) // 4
                offsets = (offsets // 18, offsets % 18 // 3, 0)
                data = block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                for start, local, length in byte_runs(offsets, tuple(block.shape), tuple(whole.shape), 4):
                    buffer[start:start + length] = data[local:local + length]
        assert bytes(buffer) == whole.reshape(-1).view(torch.uint8).numpy().tobytes(), (row_parts, column_parts)


@pytest.mark.parametrize("killed", ["writing", "written"])
def test_a_writer_killed_mid_export_leaves_no_file_a_loader_would_take(tmp_path, monkeypatch, killed):
    """The weights/ export dies (as under SIGKILL) while the ranks write their blocks, or once they all wrote but
    before rank 0's renames: the hidden .weights.tmp/ holds only FILE.partial, which neither a *.safetensors glob, nor
    model.init_from, nor safe_open's callers pick up; weights/ keeps the earlier run's; the next export is complete."""
    import distrib.checkpoint.weights as weights

    model = llama()
    tensors = model_tensors(model)
    folder = tmp_path / "weights"
    save_weights({name: torch.zeros_like(t) for name, t in tensors.items()}, folder, 0, max_file_bytes=40_000)
    earlier = read_weights(folder)

    class Killed(BaseException):
        pass

    def die(*args):
        raise Killed

    if killed == "writing":
        monkeypatch.setattr(weights.os, "pwrite", die)
    else:
        monkeypatch.setattr(weights, "_finish", die)
    with pytest.raises(Killed):
        save_weights(tensors, folder, 0, max_file_bytes=40_000)
    tmp = tmp_path / ".weights.tmp"
    names = sorted(path.name for path in tmp.iterdir())
    assert len(names) > 1 and all(name.endswith(".safetensors.partial") for name in names), names
    assert not list(tmp.glob("*.safetensors"))
    with pytest.raises(UserError, match="a folder without .safetensors files"):
        open_source(str(tmp))
    assert _equal(read_weights(folder), earlier)  # the earlier export, untouched
    monkeypatch.undo()
    save_weights(tensors, folder, 0, max_file_bytes=40_000)
    assert _equal(read_weights(folder), tensors) and not tmp.exists()
    assert not list(folder.glob("*.partial"))


def test_layout_starts_a_new_file_past_the_limit():
    tensors = {f"t{i}": torch.zeros(100) for i in range(5)}  # 400 bytes each
    files = layout(tensors, max_file_bytes=1000)
    assert list(files) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [list(spec["at"]) for spec in files.values()] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert all(len(spec["header"]) % 8 == 0 for spec in files.values())


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_saved_in_several_files_loads_with_from_pretrained(tmp_path, tied):
    from transformers import LlamaForCausalLM

    model = llama(tie_word_embeddings=tied)
    tensors = model_tensors(model)
    assert ("lm_head.weight" in tensors) is not tied  # a tied weight once, as save_pretrained writes it
    save_weights(tensors, tmp_path / "weights", 0, hf_config(model), max_file_bytes=40_000)
    names = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert INDEX in names and "config.json" in names and len([n for n in names if n.endswith(".safetensors")]) > 1
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "weights")
    assert _equal(loaded.state_dict(), model.state_dict())
    assert _equal(read_weights(tmp_path / "weights"), tensors)


def _fsdp_llama(mesh):
    from torch.distributed.fsdp import fully_shard

    model = llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_rank_1_of_fsdp_2_reads_only_its_rows(tmp_path, monkeypatch):
    """Every byte rank 1 reads is counted where safetensors hands it over: exactly its half of each tensor (rows
    n/2..n), and its shards then hold those rows of the saved weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    folder = save_llama(tmp_path / "llama")
    reference = LlamaForCausalLM.from_pretrained(folder).state_dict()
    read = []
    real_read = Safetensors.read
    monkeypatch.setattr(Safetensors, "read", lambda self, name, slices: read.append(real_read(self, name, slices))
                        or read[-1])
    with fake_rank(1, 2):
        model = _fsdp_llama(init_device_mesh("cpu", (2,)))
        pretrained = check_weights(model, open_source(str(folder)))
        plan = read_plan(model.state_dict())
        assert plan["model.embed_tokens.weight"] == ((128, 0), (128, 32))  # 256 rows: rank 1 reads 128..255
        note = load_weights(model, pretrained)
        for name, tensor in model.state_dict().items():
            half = reference[name].shape[0] // 2
            assert torch.equal(tensor.to_local(), reference[name][half:]), name
    assert len(read) == len(reference)
    assert sum(t.numel() for t in read) * 2 == sum(t.numel() for t in reference.values())
    assert f"each rank read {sum(t.numel() * 4 for t in read) / 2**20:.2f}" in note  # the log counts the same bytes


def test_rank_3_of_tensor_parallel_2_by_fsdp_2_reads_its_block_of_a_torch_file(tmp_path):
    """Column and row blocks (tensor parallel) inside fsdp's rows, read from a memory-mapped model.pt."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)).state_dict()
    torch.save(whole, tmp_path / "model.pt")
    with fake_rank(3, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        source = open_source(str(tmp_path))
        assert isinstance(source, TorchFile)
        load_weights(model, check_weights(model, source))
        state = model.state_dict()
        for name, (offsets, sizes) in read_plan(state).items():
            block = whole[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert torch.equal(state[name].to_local(), block), name
        assert read_plan(state)["2.weight"] == ((2, 3), (2, 3))  # rows 2..3 (fsdp), columns 3..5 (tensor parallel)


def test_weights_of_another_model_are_refused_in_one_line(tmp_path):
    folder = str(save_llama(tmp_path / "llama"))
    with pytest.raises(UserError) as wider:
        check_weights(llama(hidden_size=64), open_source(folder))
    message = str(wider.value)
    assert "\n" not in message and "do not fit the model" in message
    assert ("21 mis-shaped (first model.embed_tokens.weight: [256, 32] in the weights, [256, 64] in the model)"
            in message)
    with pytest.raises(UserError, match=r"9 missing \(first model.layers.2.self_attn.q_proj.weight\)"):
        check_weights(llama(num_hidden_layers=3), open_source(folder))
    with pytest.raises(UserError, match=r"9 unexpected \(first model.layers.1\."):
        check_weights(llama(num_hidden_layers=1), open_source(folder))


def test_hugging_face_prefix_and_tied_weight_conventions(tmp_path):
    from transformers import LlamaModel

    from tests.helpers.pretrained import llama_config

    folder = str(save_llama(tmp_path / "llama"))
    base = LlamaModel(llama_config())  # a base model from a model with a head: the head is left out
    pretrained = check_weights(base, open_source(folder))
    assert pretrained.left_out == ["lm_head.weight"] and "without the prefix model." in load_weights(base, pretrained)
    tied_folder = str(save_llama(tmp_path / "tied", tie_word_embeddings=True))  # the file holds no lm_head.weight
    tied = llama(tie_word_embeddings=True)
    load_weights(tied, check_weights(tied, open_source(tied_folder)))
    assert torch.equal(tied.lm_head.weight, tied.model.embed_tokens.weight)
    save_weights(model_tensors(base), tmp_path / "base", 0)  # a full model from a base one: the head is missing
    with pytest.raises(UserError, match=r"1 missing \(first lm_head.weight\)"):
        check_weights(llama(), open_source(str(tmp_path / "base")))


def test_one_file_and_sharded_checkpoints_and_model_pt_as_sources(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).state_dict()
    torch.save({"format": FORMAT, "model": saved, "optimizer": {}}, tmp_path / "step_00000004.pt")
    dcp.save({"model": saved, "optimizer": {"lr": 0.1}}, checkpoint_id=tmp_path / "step_00000008")  # one process
    torch.save({"module." + name: t for name, t in saved.items()}, tmp_path / "ddp.pt")  # saved from the wrapper
    for path in ("step_00000004.pt", "step_00000008", "ddp.pt"):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        load_weights(model, check_weights(model, open_source(str(tmp_path / path))))
        assert _equal(model.state_dict(), saved), path


def test_a_path_that_holds_no_weights_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("no weights here")
    for path, why in ((tmp_path / "nothing", "no such file or folder"), (tmp_path, "a folder without .safetensors"),
                      (tmp_path / "notes.txt", "not readable as safetensors or a torch file")):
        with pytest.raises(UserError, match=f"model.init_from = .*: {why}.*; give a Hugging Face folder"):
            open_source(str(path))


def test_damaged_weights_are_one_line_naming_the_file_exit_2_at_world_1(tmp_path, capsys):
    """A safetensors file truncated, of 50 bytes, or of random bytes (distrib train in this process; under fsdp at
    world size 2: tests/integration/test_pretrained.py), and a sharded checkpoint whose shard is cut or whose
    .metadata is garbled: one line that names the file and says to copy it again, exit 2, nothing written."""
    from distrib import cli

    files = damaged_weights(tmp_path / "damaged")
    torch.manual_seed(0)
    dcp_saved = tmp_path / "step_00000004"
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": nn.Linear(4, 3).state_dict()}, checkpoint_id=dcp_saved)  # one process
    capsys.readouterr()  # save_pretrained's progress bars
    for name, path in files.items():
        run_dir = tmp_path / f"run_{name}"
        overrides = ("data.factory=tests.helpers.pretrained:token_dicts", "train.max_steps=2",
                     "train.global_batch_size=16", "model.factory=tests.helpers.pretrained:llama", "run.progress=false",
                     "dist.device=cpu", f"model.init_from={path.parent}", f"run.dir={run_dir}")
        argv = ["train", *[item for each in overrides for item in ("--set", each)]]
        assert cli.main(argv) == 2, name
        out = capsys.readouterr().err.strip()
        err = out.splitlines()[-1]
        assert out.count("error") == 1 and "Traceback" not in out, out
        assert err.startswith(f"distrib: error: model.init_from = '{path.parent}': {path} is not a readable "
                              "safetensors file (SafetensorError: Error while deserializing header: "), err
        assert err.endswith("it is damaged or incomplete (a download or copy cut short?): copy or download it "
                            "again, or give another model.init_from"), err
        assert not run_dir.exists()
    shard = next(dcp_saved.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    model = nn.Linear(4, 3)
    with pytest.raises(UserError, match=r"step_00000004 is not a readable sharded checkpoint \(on rank 0\) "
                                        r"\(RuntimeError: PytorchStreamReader failed"):
        load_weights(model, check_weights(model, open_source(str(dcp_saved))))
    (dcp_saved / ".metadata").write_bytes(b"\x80garbled")
    with pytest.raises(UserError, match=r"\.metadata is not a readable sharded checkpoint's metadata"):
        open_source(str(dcp_saved))


def test_eval_predict_and_generate_read_weights_when_there_is_no_model_pt(tmp_path):
    """A large sharded run writes weights/ only (model.pt only where model_pt_is_cheap): load_trained reads it, and
    the model is rebuilt with those weights."""
    from distrib.checkpoint.weights import MODEL_PT_MAX_BYTES, model_pt_is_cheap
    from distrib.config import write_resolved
    from distrib.data import DataInfo
    from distrib.models.network import Network
    from distrib.training.trained import load_trained, rebuilt_model
    from tests.helpers.support import small_config

    write_resolved(small_config(tmp_path), tmp_path)
    torch.manual_seed(3)
    model = Network()
    save_weights(model_tensors(model), tmp_path / "weights", 0)
    trained = load_trained(str(tmp_path))
    assert _equal(trained.weights, model.state_dict())
    info = DataInfo(name="synthetic", input_shape=(1, 28, 28), num_classes=10,
                    class_names=tuple(str(i) for i in range(10)), mean=(), std=())
    assert _equal(rebuilt_model(trained, info).state_dict(), model.state_dict())
    big = {"w": torch.empty(MODEL_PT_MAX_BYTES // 4 + 1, device="meta")}
    assert model_pt_is_cheap(big, sharded=False) and not model_pt_is_cheap(big, sharded=True)


def test_a_weights_folder_given_is_the_model_evaluated_not_its_run(tmp_path):
    """`distrib eval RUN/weights` (or weights_ema/, or any folder of safetensors) reads that folder's tensors, built
    by the config of the run that holds it (or --config), and writes eval.json beside the folder, not in it; a folder
    outside a run without --config, and a peft adapter alone, are one line."""
    from distrib.config import write_resolved
    from distrib.models.network import Network
    from distrib.training.trained import load_trained
    from tests.helpers.support import small_config

    write_resolved(small_config(tmp_path), tmp_path)
    torch.manual_seed(3)
    run_model, ema_model = Network(), Network()
    torch.save(run_model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "summary.json").write_text('{"steps": 12}')
    for name, model in (("weights", run_model), ("weights_ema", ema_model)):
        save_weights(model_tensors(model), tmp_path / name, 0)
    assert load_trained(str(tmp_path)).source == tmp_path
    for name, model in (("weights", run_model), ("weights_ema", ema_model)):
        trained = load_trained(str(tmp_path / name))
        assert trained.source == tmp_path / name and trained.out_dir == tmp_path and trained.step == 12
        assert _equal(trained.weights, model.state_dict())
    assert not _equal(load_trained(str(tmp_path / "weights_ema")).weights, run_model.state_dict())
    outside = tmp_path.parent / f"{tmp_path.name}_exported"
    shutil.copytree(tmp_path / "weights_ema", outside)
    with pytest.raises(UserError) as error:
        load_trained(str(outside))
    assert str(error.value) == (f"{outside}: a folder of weights outside a distrib run (no config.toml beside it or "
                                "above it); give the config that builds its model and loads its data: --config FILE")
    trained = load_trained(str(outside), str(tmp_path / "config.toml"), ["train.seed=5"])
    assert _equal(trained.weights, ema_model.state_dict()) and trained.config.train.seed == 5
    (tmp_path / "weights" / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError) as error:
        load_trained(str(tmp_path / "weights"))
    assert str(error.value) == (f"{tmp_path}/weights: a peft adapter alone, not a whole model, so distrib eval cannot "
                                f"evaluate it; give {tmp_path} (its model.pt) or a merged folder "
                                "(model.merged_weights)")


def test_a_runs_weights_come_in_files_of_model_max_shard_size_and_model_pt_in_one(tmp_path):
    """write_run_weights splits weights/ at max_file_bytes (model.max_shard_size) with its index, as save_pretrained
    does, and rank 0 writes model.pt itself; under a sharded strategy model.pt (gathered whole on rank 0) only for a
    model of at most one such file, so rank 0's save never holds more than one file above the other ranks."""
    from distrib.checkpoint.run_weights import write_run_weights
    from distrib.checkpoint.weights import model_pt_is_cheap
    from distrib.distributed.strategies import DDPStrategy
    from distrib.models.network import Network

    torch.manual_seed(0)
    model = Network()
    tensors = model_tensors(model)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert write_run_weights(model, None, tmp_path, 0, DDPStrategy(), max_file_bytes=nbytes // 3) == ["model.pt"]
    assert (tmp_path / "weights" / INDEX).is_file() and len(list((tmp_path / "weights").glob("*.safetensors"))) > 2
    assert _equal(read_weights(tmp_path / "weights"), model.state_dict())
    assert _equal(torch.load(tmp_path / "model.pt", weights_only=True), model.state_dict())
    assert model_pt_is_cheap(tensors, sharded=True, max_file_bytes=nbytes)
    assert not model_pt_is_cheap(tensors, sharded=True, max_file_bytes=nbytes - 1)
    assert model_pt_is_cheap(tensors, sharded=False, max_file_bytes=1)  # ddp's rank 0 holds it anyway
