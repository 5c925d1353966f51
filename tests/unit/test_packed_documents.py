"""Packed documents (data.document_mask): a window of three documents gives each document the logits it has alone,
for the built-in GPT and a transformers Llama; the data's positions restart after data.eos_id and at each file's first
token; the keys' refusals are one line."""

import pytest
import torch

from distrib.config import ConfigError, load_config
from distrib.data import load_data
from distrib.data.documents import document_positions, document_starts, packed_inputs
from distrib.distributed.runtime import Runtime
from distrib.models.gpt import GPT
from distrib.training.losses import forward, logits_of

CPU = Runtime(0, 0, 1, 1, torch.device("cpu"), backend="none")
EOS, VOCAB = 0, 64


def _documents(lengths=(5, 9, 4)) -> list[torch.Tensor]:
    """Documents of random ids 1..VOCAB-1, each ending with EOS."""
    generator = torch.Generator().manual_seed(0)
    return [torch.cat([torch.randint(1, VOCAB, (n - 1,), generator=generator), torch.tensor([EOS])]) for n in lengths]


def _each_alone_vs_packed(model) -> tuple[list[float], list[float]]:
    """(max |packed - alone| of each document's logits with the mask, the same without it), the packed window run as
    a batch of distrib's is (training.losses.forward)."""
    documents = _documents()
    window = torch.cat(documents)[None]
    with torch.no_grad():
        masked = logits_of(forward(model, packed_inputs(window, EOS)))
        plain = logits_of(model(window))
        start, errors, unmasked = 0, [], []
        for document in documents:
            alone = logits_of(model(document[None]))[0]
            end = start + len(document)
            errors.append((masked[0, start:end] - alone).abs().max().item())
            unmasked.append((plain[0, start:end] - alone).abs().max().item())
            start = end
    return errors, unmasked


def test_each_document_of_a_packed_window_has_its_own_logits_in_the_gpt():
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, seq_len=32, n_layers=2, n_heads=2, dim=16)
    errors, unmasked = _each_alone_vs_packed(model)
    assert max(errors) < 1e-5, errors
    assert unmasked[0] < 1e-5 and min(unmasked[1:]) > 1e-3  # without the mask the later documents see the earlier


def test_each_document_of_a_packed_window_has_its_own_logits_in_a_transformers_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).train()  # training: where it would otherwise make a KV cache
    errors, unmasked = _each_alone_vs_packed(model)
    assert max(errors) < 1e-5, errors
    assert min(unmasked[1:]) > 1e-3


def test_the_gpt_with_one_document_is_the_causal_gpt():
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, seq_len=16, n_layers=2, n_heads=2, dim=16)
    tokens = torch.randint(1, VOCAB, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model(tokens, torch.arange(16).expand(2, 16)), model(tokens), atol=1e-6)


def test_positions_restart_after_the_end_of_document_id_and_at_a_file_start():
    tokens = torch.tensor([[7, 7, EOS, 5, 5, 5, EOS, 3], [EOS, 4, 4, 4, 4, 4, 4, 4]])
    files = torch.zeros_like(tokens, dtype=torch.bool)
    files[1, 5] = True  # the second window crosses into another file at its sixth token
    positions = document_positions(document_starts(tokens, EOS, files))
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 0, 1, 2]]
    assert document_positions(document_starts(tokens, -1)).tolist() == [list(range(8))] * 2


def test_text_data_packs_its_files_and_eos_documents(tmp_path):
    (tmp_path / "a.txt").write_text("ab|cd" * 30)  # 150 bytes
    (tmp_path / "b.txt").write_text("xyz" * 20)  # 60 bytes: the test stream (from byte 104) holds its start
    config = load_config(None, ["data.name=text", f"data.root={tmp_path}", "data.seq_len=8", "data.document_mask=true",
                                f"data.eos_id={ord('|')}", "data.test_fraction=0.5"])
    data = load_data(config.data, CPU, seed=0, log=lambda message: None)
    inputs, targets = next(data.train.batches([torch.arange(4)], epoch=0))
    assert set(inputs) == {"input_ids", "position_ids"} and targets.shape == (4, 8)
    for ids, positions in zip(inputs["input_ids"].tolist(), inputs["position_ids"].tolist()):
        for index in range(1, 8):  # a position is 0 exactly after the end of a document
            assert (positions[index] == 0) == (ids[index - 1] == ord("|")), (ids, positions)
    test_inputs, _ = next(data.test.batches([torch.arange(data.test.num_samples)]))
    ids, positions = test_inputs["input_ids"].flatten().tolist(), test_inputs["position_ids"].flatten().tolist()
    first_of_b = 150 - 104  # consecutive windows: the test stream in order
    assert ids[first_of_b - 1:first_of_b + 1] == [ord("d"), ord("x")]
    assert positions[first_of_b - 1:first_of_b + 2] == [1, 0, 1]  # "|cd", then the file's first byte starts a document


def test_document_keys_refuse_in_one_line():
    with pytest.raises(ConfigError, match=r"data.eos_id = 5: is read only by data.document_mask = true"):
        load_config(None, ["data.name=tokens", "data.vocab_size=10", "data.eos_id=5"])
    with pytest.raises(ConfigError, match=r"data.document_mask = True: packs the documents of text or tokens"):
        load_config(None, ["data.name=synthetic", "data.document_mask=true"])
    with pytest.raises(ConfigError, match=r"data.eos_id = 10: must be a token id below the vocabulary \(10\)"):
        load_config(None, ["data.name=tokens", "data.vocab_size=10", "data.eos_id=10", "data.document_mask=true"])
    # a pipeline's stages take the documents' positions from the step (distrib.distributed.step_inputs)
    assert load_config(None, ["data.name=tokens", "data.vocab_size=10", "data.eos_id=1", "data.document_mask=true",
                              "dist.pipeline_parallel=2", "model.name=gpt"]).dist.pipeline_parallel == 2


def test_plan_counts_a_packed_run(capsys):
    """distrib plan runs the packed batch ({input_ids, position_ids}) through the model as a run would: the mask and
    the per-token rotary tables are activations the causal run does not hold."""
    from distrib.cli import main
    from distrib.plan import Machine, plan_run

    gpt = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64}", "data.name=text",
           "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32", "train.global_batch_size=8",
           "dist.strategy=fsdp", "dist.device=cuda"]
    packed = [*gpt, "data.document_mask=true", "data.eos_id=10"]  # a document a line
    causal, masked = (plan_run(load_config(None, run), Machine(1, 2)) for run in (gpt, packed))
    assert masked["activation_bytes_per_micro_batch"] > causal["activation_bytes_per_micro_batch"]
    assert masked["parameter_bytes_per_rank"] == causal["parameter_bytes_per_rank"]
    assert main(["plan", "--world-size", "2", *(arg for item in packed for arg in ("--set", item))]) == 0
    assert "data.document_mask" not in capsys.readouterr().err


def test_plan_and_dry_run_of_packed_documents_under_pp2(capsys):
    """distrib plan and its dry run step each stage with the step's positions (distrib.distributed.step_inputs, the
    dry run's fake step through the pipeline runner's one_tensor), as the run does: the dry run measures a peak that
    the plan meets as closely as without documents, and the documents' masks and positions add to the measured peak
    at least what they add to the plan's, within 1% of the peak above it (here 36,352 B measured, 24,576 B planned:
    the plan counts what autograd saves, the dry run every tensor alive at the peak)."""
    from distrib.cli import main
    from distrib.plan import Machine, plan_run
    from distrib.plan.dry_run import dry_run

    causal = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64, tie_weights = false}",
              "data.name=text", "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32",
              "train.global_batch_size=8", "dist.strategy=fsdp", "dist.pipeline_parallel=2", "dist.device=cpu"]
    packed = [*causal, "data.document_mask=true", "data.eos_id=10"]
    assert main(["plan", "--world-size", "4", *(arg for item in packed for arg in ("--set", item))]) == 0
    assert "document_mask" not in capsys.readouterr().err
    figures = {}
    for name, sets in (("causal", causal), ("packed", packed)):
        config = load_config(None, sets)
        plan, measured = plan_run(config, Machine(1, 4)), dry_run(config, Machine(1, 4))
        figures[name] = (plan["memory_bytes_per_rank"] - plan["allocator_slack_bytes_per_rank"],
                         measured["dry_run_peak_bytes_per_rank"])
        assert 0.85 < figures[name][0] / figures[name][1] < 1.15, (name, figures[name])
    (planned_causal, measured_causal), (planned, measured) = figures["causal"], figures["packed"]
    assert planned / measured == pytest.approx(planned_causal / measured_causal, abs=0.01)
    # the masks' bytes (each in-flight microbatch's): measured beside the plan's count
    assert planned - planned_causal <= measured - measured_causal < planned - planned_causal + 0.01 * measured
