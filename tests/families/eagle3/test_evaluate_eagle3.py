"""Serving-faithful evaluation (issue 9): real greedy speculative decoding from exported EAGLE-3 and
MLA-EAGLE-3 drafts, the export validator, the CLI and the validation-time callback."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.callbacks import ServedAcceptanceCallback
from lightning_drafts.cli.main import main
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.eagle3 import Eagle3Base
from lightning_drafts.eagle3.reload import load_eagle3_draft
from lightning_drafts.eagle3.speculate import load_speculator
from lightning_drafts.eagle3.ttt import TTTCache
from lightning_drafts.serving.decode import greedy_generate, speculative_generate
from lightning_drafts.serving.family import Speculator, VerifiedPrefix
from lightning_drafts.serving.prompts import load_prompts_jsonl, prompts_from_batch
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import validate_export
from tests.builders import (
    TINY_TARGETS,
    VOCAB,
    PromptRows,
    assert_target_greedy,
    packed_row,
    random_docs,
    rewrite_export,
    stack_rows,
)
from tests.eagle3_checks import frequencies

FAMILIES = [(Eagle3Module, "llama"), (MLAEagle3Module, "deepseek_v3")]
FAMILY_IDS = ["eagle3", "mla_eagle3"]
STEPS = 3
# The last captured layer is the target's last layer, so its output is what the target's LM head reads.
PERFECT_LAYERS = [1, 3, 7]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decoding runs hundreds of tiny forwards; a second thread only adds synchronisation to each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- builders -----------------------------------------------------------------------------------------


def sharpened_target(name: str) -> PreTrainedModel:
    """A tiny random target whose LM head is scaled up, so its greedy choices are far from ties."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_TARGETS[name]))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    return model


def trained_module(module_class: type[Eagle3Base], name: str, steps: int = 4) -> Eagle3Base:
    """A draft trained a few optimizer steps on a fixed batch (export, not quality, is under test)."""
    torch.manual_seed(0)
    module = module_class(
        sharpened_target(name), ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    batch = stack_rows(
        [packed_row(random_docs([8, 7], seed=7), 16), packed_row(random_docs([12], seed=8), 16)]
    )
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    return module


def repeating_target(name: str) -> PreTrainedModel:
    """A real tiny target (every layer random) whose greedy output repeats its last token.

    Its embeddings are scaled up until they dominate the residual stream, and its LM head is the
    row-normalised embedding, so the final hidden state at a token is closest to that token's own row.
    """
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_TARGETS[name]))
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight.mul_(50)
        model.get_output_embeddings().weight.copy_(10 * embedding / embedding.norm(dim=-1, keepdim=True))
    return model


def perfect_module(module_class: type[Eagle3Base], name: str) -> Eagle3Base:
    """An EAGLE-3 draft that computes exactly what the target computes, from the captured features.

    ``fc`` selects the third captured chunk, the output of the target's last layer; the midlayer's two
    residual branches are zeroed, so the carried state passes through every depth unchanged; ``norm`` and
    ``lm_head`` are the target's final norm and LM-head rows of the draft vocabulary. So at every depth the
    draft's logits are the target's logits at the last verified slot, restricted to the draft vocabulary:
    for a target whose greedy output repeats its last token (:func:`repeating_target`), that is the
    target's next token at every depth. Draft ids map to target ids only through the (unsorted) ``d2t``.
    """
    target = repeating_target(name)
    torch.manual_seed(0)
    module = module_class(
        target,
        ttt_length=STEPS,
        draft_vocab_size=48,
        token_frequencies=frequencies(),
        target_layer_ids=PERFECT_LAYERS,
    )
    draft, hidden = module.draft, module.draft.fc.weight.shape[0]
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * hidden :] = torch.eye(hidden)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(target.model.norm.weight)
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[draft.selected_token_ids])
    return module


def perfect_prompts(module: Eagle3Base) -> list[torch.Tensor]:
    """Random prompts ending in draft-vocabulary tokens whose draft id differs from their target id."""
    selected = module.draft.selected_token_ids
    picks = [j for j in range(selected.numel()) if int(selected[j]) != j][:3]
    prompts = random_docs([5, 7, 9], seed=3)
    for prompt, draft_id in zip(prompts, picks, strict=True):
        prompt[-1] = selected[draft_id]
    return prompts


@pytest.fixture(scope="module")
def perfect_export(tmp_path_factory) -> tuple[Eagle3Base, Path]:
    module = perfect_module(Eagle3Module, "llama")
    return module, module.export(tmp_path_factory.mktemp("perfect") / "draft")


# --- served decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("module_class", "name"), FAMILIES, ids=FAMILY_IDS)
def test_trained_export_decodes_losslessly_with_served_and_tau_sim_side_by_side(module_class, name, tmp_path):
    module = trained_module(module_class, name)
    export = module.export(tmp_path / "draft")
    prompts = random_docs([5, 8, 11], seed=21)
    report = evaluate_export(export, prompts, target=module.target, max_new_tokens=12, stop_token_ids=())

    assert_target_greedy(module.target, prompts, report.generations, 12, with_hf=name == "llama")
    assert report.num_steps == STEPS and report.rounds >= 3 and report.generated_tokens == 3 * 12
    assert 1.0 <= report.served.accept_len <= STEPS + 1
    assert report.training is not None and 1.0 <= report.training.accept_len <= STEPS + 1
    assert len(report.served.prefix_rate) == len(report.training.prefix_rate) == STEPS
    assert report.export.target_layer_ids == (1, 3, 4)
    table = report.format_table()
    assert "served" in table and "tau_sim" in table and "accept_len" in table
    payload = json.loads(report.write_json(tmp_path / "report.json").read_text())
    assert payload["served"]["accept_len"] == report.served.accept_len
    assert payload["training"]["accept_len"] == report.training.accept_len


@pytest.mark.parametrize(("module_class", "name"), FAMILIES, ids=FAMILY_IDS)
def test_a_perfect_draft_reaches_the_maximum_acceptance_length(module_class, name, tmp_path):
    """See :func:`perfect_module`: the draft copies the target's own computation from the captured layer."""
    module = perfect_module(module_class, name)
    prompts = perfect_prompts(module)
    for prompt in prompts:
        assert greedy_generate(module.target, prompt, 6) == [int(prompt[-1])] * 6, "the target must repeat"
    export = module.export(tmp_path / "draft")
    report = evaluate_export(export, prompts, target=module.target, max_new_tokens=16, stop_token_ids=())

    assert report.served.accept_len == STEPS + 1
    assert report.served.prefix_rate == [1.0] * STEPS and report.served.position_accuracy == [1.0] * STEPS
    assert report.training.accept_len == pytest.approx(STEPS + 1)
    assert report.generations == [[int(p[-1])] * 16 for p in prompts]


def test_d2t_read_as_the_first_draft_ids_collapses_served_acceptance(perfect_export, tmp_path):
    """A self-consistent but wrong mapping (draft id i -> target id i, what engines do without d2t)
    passes the validator; only serving shows it: every proposal is rejected."""
    module, export = perfect_export

    def identity_mapping(tensors: dict) -> None:
        tensors["d2t"] = torch.zeros_like(tensors["d2t"])
        tensors["t2d"] = torch.arange(VOCAB) < tensors["d2t"].numel()

    broken = rewrite_export(export, tmp_path / "broken", tensor_edit=identity_mapping)
    validate_export(broken, module.target)
    prompts = perfect_prompts(module)
    good = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    bad = evaluate_export(
        broken, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    assert good.served.accept_len == STEPS + 1
    assert bad.served.accept_len == 1.0
    assert bad.generations == good.generations  # still lossless: the target corrects every token


def _shift_vllm_ids_to_output_convention(config: dict) -> None:
    config["eagle_aux_hidden_state_layer_ids"] = list(
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )


def _shift_engine_ids(config: dict) -> None:
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [
        i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    ]


def _shift_every_id(config: dict) -> None:
    _shift_engine_ids(config)
    config["lightning_drafts"]["target_layer_ids"] = [
        i + 1 for i in config["lightning_drafts"]["target_layer_ids"]
    ]


def _absolute_d2t(tensors: dict) -> None:
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].numel())


def _duplicate_d2t(tensors: dict) -> None:
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 now name the same target id


def _random_embedding(tensors: dict) -> None:
    tensors["embed_tokens.weight"] = torch.randn_like(tensors["embed_tokens.weight"])


BROKEN_EXPORTS = {
    "vllm ids in the output convention": (
        _shift_vllm_ids_to_output_convention,
        None,
        r"eagle_aux_hidden_state_layer_ids: is \[1, 3, 7\]",
    ),
    "engine ids shifted from training": (
        _shift_engine_ids,
        None,
        r"eagle_config\.eagle_aux_hidden_state_layer_ids: is \[2, 4, 8\]",
    ),
    "every id shifted past the target": (_shift_every_id, None, "outside the target's 8 decoder layers"),
    "convention not recorded": (
        lambda c: c["lightning_drafts"].pop("layer_id_convention"),
        None,
        "layer_id_convention",
    ),
    "dropped lm_head": (None, lambda t: t.pop("lm_head.weight"), "lm_head.weight: missing"),
    "zeroed lm_head": (None, lambda t: t["lm_head.weight"].zero_(), "lm_head.weight: is constant"),
    "d2t as absolute ids": (None, _absolute_d2t, "d2t: .*absolute target ids"),
    "d2t not one to one": (None, _duplicate_d2t, "d2t: maps two draft ids"),
    "t2d out of step": (None, lambda t: t["t2d"].logical_not_(), "t2d: marks"),
    "random embedding": (None, _random_embedding, "embed_tokens.weight: differs from the target"),
    "NaN weight": (None, lambda t: t["fc.weight"].fill_(float("nan")), "fc.weight: holds NaN"),
    "rope_theta dropped": (lambda c: c.pop("rope_theta"), None, "rope_theta"),
    "rope_scaling dropped": (lambda c: c.pop("rope_scaling"), None, "rope_scaling: missing"),
    "head_dim dropped": (lambda c: c.pop("head_dim"), None, "head_dim: missing"),
    "two layers": (lambda c: c.update(num_hidden_layers=2), None, "num_hidden_layers"),
}


@pytest.mark.parametrize("case", list(BROKEN_EXPORTS))
def test_the_validator_names_each_defect(case, perfect_export, tmp_path):
    module, export = perfect_export
    config_edit, tensor_edit, message = BROKEN_EXPORTS[case]
    broken = rewrite_export(export, tmp_path / "broken", config_edit, tensor_edit)
    with pytest.raises(ValueError, match=message):
        validate_export(broken, module.target)


def test_evaluate_refuses_a_broken_export_before_decoding(perfect_export, tmp_path):
    module, export = perfect_export
    broken = rewrite_export(export, tmp_path / "broken", tensor_edit=lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight: missing"):
        evaluate_export(broken, perfect_prompts(module), target=module.target, max_new_tokens=4)


def test_an_lm_head_still_at_its_initialisation_is_refused(tmp_path):
    torch.manual_seed(0)
    module = Eagle3Module(
        TINY_TARGETS["llama"], ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    with pytest.raises(ValueError, match="lm_head.weight: is bit-identical to its random initialisation"):
        module.export(tmp_path / "untrained")


def test_the_mla_layout_needs_interleaved_rope_and_its_latent_ranks(tmp_path):
    torch.manual_seed(0)
    module = MLAEagle3Module(
        TINY_TARGETS["deepseek_v3"], ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    export = module.export(tmp_path / "draft")

    def break_config(config: dict) -> None:
        config["rope_interleave"] = False
        config.pop("kv_lora_rank")

    broken = rewrite_export(export, tmp_path / "broken", config_edit=break_config)
    with pytest.raises(ValueError, match="(?s)kv_lora_rank: missing.*rope_interleave"):
        validate_export(broken, module.target)


def test_the_served_draft_is_built_from_the_config_and_matches_the_trained_one(tmp_path):
    """Shapes and RoPE (here llama3-scaled) come from config.json, not the target, and agree with training."""
    scaled = {
        **TINY_TARGETS["llama"],
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    }
    torch.manual_seed(0)
    module = Eagle3Module(scaled, ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies())
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    draft, config = load_eagle3_draft(module.export(tmp_path / "draft"))
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 50000.0
    trained_rope = module.draft.midlayer.self_attn.rope
    assert torch.equal(draft.midlayer.self_attn.rope.inv_freq, trained_rope.inv_freq)
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(9)[None] + 40  # past original_max_position_embeddings, where scaling matters
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        served = draft.step(ids, hidden, positions, TTTCache(), mask)
        trained = module.draft.step(ids, hidden, positions, TTTCache(), mask)
    torch.testing.assert_close(served, trained, rtol=0, atol=0)


@pytest.mark.parametrize(("module_class", "name"), FAMILIES, ids=FAMILY_IDS)
def test_the_served_chain_equals_the_training_unroll(module_class, name, tmp_path):
    """Drafting from the exported files, fed the true tokens, gives training's TTT logits at every depth:
    same captured layers, RoPE positions, context keys (Block 1) and per-chain diagonal keys."""
    torch.manual_seed(0)
    module = module_class(
        TINY_TARGETS[name], ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    with torch.no_grad():
        for parameter in module.draft.parameters():
            if parameter.requires_grad:  # away from the init everywhere, norms included
                parameter.add_(0.05 * torch.randn_like(parameter))
    speculator = load_speculator(module.export(tmp_path / "draft"), module.target, STEPS)
    document = random_docs([14], seed=60)[0]
    with torch.no_grad():
        trained = module.draft_logits({"input_ids": document[None]})  # [K, 1, T, V_d]
    for slot in (0, 5, 10):
        context = validate_batch({"input_ids": document[None, : slot + 1]})
        features = module.target(context, speculator.target_layer_ids)
        prefix = VerifiedPrefix(
            document[: slot + 2],
            tuple(h[0] for h in features.hidden_states),
            features.last_hidden_state[0],
            module.target,
        )
        tokens, served = speculator.chain(prefix, forced=document[slot + 2 : slot + 1 + STEPS])
        torch.testing.assert_close(served, trained[:, 0, slot], rtol=1e-5, atol=1e-5)
        first = trained[0, 0, slot].argmax()
        assert int(tokens[0]) == int(module.draft.selected_token_ids[first])


# --- the family-agnostic loop -------------------------------------------------------------------------


class ScriptedSpeculator:
    """Proposes the reference continuation, right for ``correct`` tokens per round, then wrong."""

    def __init__(self, reference: list[int], prompt_length: int, num_steps: int, correct: int) -> None:
        self.reference, self.prompt_length = reference, prompt_length
        self.num_steps, self.correct = num_steps, correct
        self.target_layer_ids = (2,)

    def propose(self, prefix: VerifiedPrefix) -> torch.Tensor:
        done = prefix.tokens.numel() - self.prompt_length
        assert prefix.hidden_states[0].shape[0] == prefix.tokens.numel() - 1
        right = torch.tensor(self.reference[done : done + self.num_steps])
        wrong = (right + 1) % VOCAB
        return torch.where(torch.arange(right.numel()) < self.correct, right, wrong)


@pytest.mark.parametrize("correct", [4, 2, 0])
def test_the_verify_loop_accepts_the_longest_matching_prefix(correct):
    target = FrozenTarget(sharpened_target("llama"))
    prompt = random_docs([6], seed=30)[0]
    reference = greedy_generate(target, prompt, 40)
    speculator = ScriptedSpeculator(reference, prompt.numel(), num_steps=4, correct=correct)
    assert isinstance(speculator, Speculator)
    generation = speculative_generate(target, speculator, prompt, max_new_tokens=21)
    assert generation.tokens == reference[:21]
    assert set(generation.accepted) == {correct} and set(generation.proposed) == {4}
    # One token from the prefill, then correct + 1 per round.
    assert len(generation.accepted) == -(-20 // (correct + 1))


def test_a_speculator_returning_bad_proposals_is_refused():
    target = FrozenTarget(sharpened_target("llama"))

    class TooMany(ScriptedSpeculator):
        def propose(self, prefix):
            return torch.zeros(self.num_steps + 1, dtype=torch.long)

    class DraftIds(ScriptedSpeculator):
        def propose(self, prefix):
            return torch.tensor([VOCAB + 3])

    prompt = random_docs([4], seed=31)[0]
    with pytest.raises(ValueError, match="more than num_steps=2"):
        speculative_generate(target, TooMany([], 4, 2, 0), prompt, 5)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        speculative_generate(target, DraftIds([], 4, 2, 0), prompt, 5)


def test_prompts_are_the_tokens_before_each_documents_first_supervised_token(tmp_path):
    docs = random_docs([7, 6, 5], seed=40)
    batch = stack_rows([packed_row(docs[:2], 16), packed_row(docs[2:], 16)])
    batch["loss_mask"][0, :3] = 0  # doc 0: a 3-token prompt
    batch["loss_mask"][0, 7:9] = 0  # doc 1: a 2-token prompt
    batch["loss_mask"][1, :] = 0  # doc 2: nothing supervised, no prompt
    prompts = prompts_from_batch(batch, limit=5)
    assert [p.tolist() for p in prompts] == [docs[0][:3].tolist(), docs[1][:2].tolist()]
    lines = [json.dumps(docs[0].tolist()), json.dumps({"prompt_ids": [5, 6]}), ""]
    lines.append(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}))
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines))
    loaded = load_prompts_jsonl(tmp_path / "prompts.jsonl")
    assert [p.tolist() for p in loaded] == [docs[0].tolist(), [5, 6], [1, 2]]


# --- CLI ----------------------------------------------------------------------------------------------


def test_cli_evaluate_prints_the_table_and_writes_json(tmp_path, capsys):
    torch.manual_seed(0)
    module = Eagle3Module(
        TINY_TARGETS["llama"], ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    export = module.export(tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.tolist()) for p in random_docs([4, 6, 5], seed=50)))
    target_file = tmp_path / "target.json"
    target_file.write_text(json.dumps(TINY_TARGETS["llama"]))

    # The export records its config-dict target; --target gives it explicitly from a JSON file.
    for extra in ([], ["--target", str(target_file)]):
        out = tmp_path / f"report{len(extra)}.json"
        main(
            [
                "evaluate",
                str(export),
                "--prompts",
                str(prompts),
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "5",
            ]
            + ["--ignore-eos", "--check-lossless", "--json", str(out), *extra]
        )
        printed = capsys.readouterr().out
        assert "accept_len" in printed and "tau_sim" in printed and "lossless: yes" in printed
        report = json.loads(out.read_text())
        assert report["num_prompts"] == 2 and report["generated_tokens"] == 10 and report["lossless"] is True
        assert report["served"]["accept_len"] >= 1.0 and report["training"]["accept_len"] >= 1.0


def test_cli_evaluate_takes_held_out_prompts_from_the_data_module(tmp_path, capsys):
    from lightning_drafts.datamodules import load_embedded_tokenizer

    chats = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ]
        }
        for i in range(6)
    ]
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(row) for row in chats))
    target = {**TINY_TARGETS["llama"], "vocab_size": 32000}  # the embedded tokenizer's vocabulary
    torch.manual_seed(0)
    counts = torch.randint(1, 50, (32000,), generator=torch.Generator().manual_seed(0))
    module = Eagle3Module(target, ttt_length=STEPS, draft_vocab_size=64, token_frequencies=counts)
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    export = module.export(tmp_path / "draft")
    out = tmp_path / "report.json"
    main(
        ["evaluate", str(export), "--data-files", str(tmp_path / "chats.jsonl"), "--val-fraction", "0.5"]
        + ["--cache-dir", str(tmp_path / "cache"), "--num-prompts", "2", "--max-new-tokens", "3"]
        + ["--ignore-eos", "--no-training-estimate", "--json", str(out)]
    )
    assert "served" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 2 and report["training"] is None
    tokenizer = load_embedded_tokenizer()
    for prompt in report["prompts"]:
        text = tokenizer.decode(prompt)
        # The prompt is the rendered user turn, cut right before the assistant's answer.
        assert "question" in text and "answer" not in text, text


# --- callback -----------------------------------------------------------------------------------------


def test_the_callback_logs_served_acceptance_beside_the_training_estimate(tmp_path):
    torch.manual_seed(0)
    module = Eagle3Module(
        TINY_TARGETS["llama"], ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    callback = ServedAcceptanceCallback(num_prompts=3, max_new_tokens=6)
    trainer = L.Trainer(
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loaders = DataLoader(PromptRows(4), batch_size=2), DataLoader(PromptRows(2), batch_size=2)
    trainer.fit(module, *loaders)
    logged = trainer.logged_metrics
    assert "val/accept_len" in logged and "val/served_accept_len" in logged
    assert 1.0 <= float(logged["val/served_accept_len"]) <= STEPS + 1
    # The sanity check does not count; the one real validation run does.
    assert callback.validation_runs == 1
    with pytest.raises(ValueError, match="every_n_val_epochs"):
        ServedAcceptanceCallback(every_n_val_epochs=0)


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_the_callback_refuses_a_sharded_strategy_before_training(strategy):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    sharded = FSDPStrategy() if strategy == "fsdp1" else ModelParallelStrategy()
    with pytest.raises(ValueError, match=f"the strategy is {type(sharded).__name__} \\(sharded\\)"):
        ServedAcceptanceCallback().setup(SimpleNamespace(strategy=sharded), None, "fit")


def test_evaluate_data_keeps_the_configs_tokenisation_and_warns_without_a_held_out_split(monkeypatch):
    import argparse

    import lightning_drafts.datamodules as datamodules
    from lightning_drafts.cli import evaluate as evaluate_cli

    made = []
    monkeypatch.setattr(datamodules, "PackedChatDataModule", lambda **kwargs: made.append(kwargs))
    config = {"data": {"init_args": {"tokenizer": "tok", "chat_template": "{{ x }}", "val_fraction": 0.1}}}
    new_files = argparse.Namespace(
        data_files=["chats.jsonl"], tokenizer=None, val_fraction=0.05, cache_dir=None
    )
    evaluate_cli._datamodule(config, new_files)
    assert made[-1] == {
        "data_files": ["chats.jsonl"],
        "tokenizer": "tok",
        "chat_template": "{{ x }}",
        "val_fraction": 0.05,
    }

    no_split = {"data": {"init_args": {"max_tokens": 256}}}
    from_config = argparse.Namespace(data_files=None, tokenizer=None, val_fraction=0.05, cache_dir=None)
    with pytest.warns(
        UserWarning, match="no validation split: prompts come from .* documents the draft trained on"
    ):
        evaluate_cli._datamodule(no_split, from_config)
    assert made[-1]["val_fraction"] == evaluate_cli.DEFAULT_VAL_FRACTION
