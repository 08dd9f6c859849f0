"""`lightning-drafts evaluate`: every family's export served from the CLI, with the target the export
records or one given as a JSON file; prompts from the data module's held-out split; the data options the
command keeps from a training config."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from lightning_drafts import Eagle3Module
from lightning_drafts.cli.main import main
from lightning_drafts.serving.export_files import CARD_FILE
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import export_module
from tests.families.cases import CASES, FAMILIES
from tests.families.eagle3.cases import STEPS, perfect_module, perfect_prompts, repeating_target
from tests.families.family_case import FamilyCase
from tests.support.builders import TINY_TARGETS, random_docs

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures"),
]
MODULES = [pytest.param(family, CASES[cls], id=cls.__name__) for family in FAMILIES for cls in family.modules]


@pytest.mark.parametrize(("family", "case"), MODULES, indirect=["family"])
def test_cli_evaluate_serves_an_export_with_the_target_it_records_or_one_given(
    family, case: FamilyCase, tmp_path, capsys
):
    kind = case.targets[0]
    module = case.build(TINY_TARGETS[kind])
    export = export_module(module, tmp_path / "draft")
    config = json.loads((export / "config.json").read_text())
    record = config["lightning_drafts"]
    assert record["target"] == TINY_TARGETS[kind] and record["target_seed"] == 0
    prompt_ids = random_docs([4, 6, 5], vocab=case.vocab, seed=50)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.tolist()) for p in prompt_ids))
    # The library call the command stands for, on the same export, the first two prompts and options.
    expected = evaluate_export(
        export, prompt_ids[:2], target=module.target, max_new_tokens=5, stop_token_ids=(), check_lossless=True
    )
    target_file = tmp_path / "target.json"
    target_file.write_text(json.dumps(TINY_TARGETS[kind]))

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
        assert report["architecture"] == config["architectures"][0]
        assert report["num_prompts"] == 2 and report["generated_tokens"] == 10 and report["lossless"] is True
        assert report["served"] == expected.to_dict()["served"]
        assert report["training"] == expected.to_dict()["training"]
        assert report["generations"] == expected.generations
        # The card names the prompts file, not where it lay on this machine.
        card = (export / CARD_FILE).read_text()
        assert "`prompts.jsonl`" in card and str(tmp_path) not in card


def eagle3_export(target: dict, directory) -> str:
    """An EAGLE-3 export of ``target`` with a vocabulary mapping and a head moved off its initialisation
    (the validator refuses an untrained head)."""
    torch.manual_seed(0)
    counts = torch.randint(1, 50, (target["vocab_size"],), generator=torch.Generator().manual_seed(0))
    module = Eagle3Module(target, ttt_length=STEPS, draft_vocab_size=64, token_frequencies=counts)
    with torch.no_grad():
        module.draft.lm_head.weight.mul_(1.5)
    return export_module(module, directory)


def test_cli_evaluate_takes_held_out_prompts_from_the_data_module(tmp_path, capsys, caplog):
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
    export = eagle3_export(target, tmp_path / "draft")
    out = tmp_path / "report.json"
    with caplog.at_level(logging.INFO):
        main(
            ["evaluate", str(export), "--data-files", str(tmp_path / "chats.jsonl"), "--val-fraction", "0.5"]
            + ["--cache-dir", str(tmp_path / "cache"), "--num-prompts", "2", "--max-new-tokens", "3"]
            + ["--ignore-eos", "--no-training-estimate", "--json", str(out)]
        )
    assert "served" in capsys.readouterr().out
    # Its phases and progress, in order, from the start (stderr is no terminal here: log lines, no bar);
    # no training sample of the data module.
    logged = [r.getMessage() for r in caplog.records]
    assert not any("training sample" in line for line in logged)
    phases = [
        "evaluate: tokenising the held-out prompts of",
        "evaluate: 2 prompts",
        "evaluate: loading the target (a config-dict target)",
        "evaluate: validating the export",
        "speculative decoding: 2 prompts",
        "speculative decoding: 1/2 prompts (50%),",
        "speculative decoding: 2/2 prompts (100%),",
    ]
    found = [next(i for i, line in enumerate(logged) if line.startswith(phase)) for phase in phases]
    assert found == sorted(found), logged
    assert re.search(r"2/2 prompts \(100%\), [\d.]+ prompts/s, [\d.]+ tokens/s, 0 s left", logged[found[-1]])
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 2 and report["training"] is None
    tokenizer = load_embedded_tokenizer()
    for prompt in report["prompts"]:
        text = tokenizer.decode(prompt)
        # The prompt is the rendered user turn, cut right before the assistant's answer.
        assert "question" in text and "answer" not in text, text


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
        "setup_summary": False,
    }

    no_split = {"data": {"init_args": {"max_tokens": 256}}}
    from_config = argparse.Namespace(data_files=None, tokenizer=None, val_fraction=0.05, cache_dir=None)
    with pytest.warns(
        UserWarning, match="no validation split: prompts come from .* documents the draft trained on"
    ):
        evaluate_cli._datamodule(no_split, from_config)
    assert made[-1]["val_fraction"] == evaluate_cli.DEFAULT_VAL_FRACTION


def test_cli_evaluate_serves_trees_and_sweeps_tree_settings(tmp_path, capsys):
    """``--topk``/``--num-draft-tokens`` serve one tree setting, ``--sweep`` a grid on the same prompts: the
    perfect draft's chains are accepted whole, so a top-1 row matches the chain decode of its depth, and
    every round of a tree verifies all its num_draft_tokens - 1 nodes."""
    module = perfect_module(Eagle3Module, "llama")
    export = module.export(tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.tolist()) for p in perfect_prompts(module)[:2]))
    repeating_target("llama").save_pretrained(tmp_path / "target")  # the perfect draft's target
    common = ["evaluate", str(export), "--prompts", str(prompts), "--max-new-tokens", "8", "--ignore-eos"]
    common += ["--target", str(tmp_path / "target")]
    common += ["--check-lossless", "--no-card", "--no-training-estimate", "--no-baseline"]
    main(
        [
            *common,
            "--num-steps",
            "3",
            "--topk",
            "2",
            "--num-draft-tokens",
            "5",
            "--json",
            str(tmp_path / "t.json"),
        ]
    )
    assert "greedy, trees of steps 3, topk 2, draft tokens 5" in capsys.readouterr().out
    tree = json.loads((tmp_path / "t.json").read_text())
    assert tree["tree"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 5} and tree["lossless"] is True
    assert {p for request in tree["proposed"] for p in request} == {4}
    # Sampled (no lossless check: a sampled decode matches the target's distribution, not its tokens).
    sampled = [a for a in common if a != "--check-lossless"] + ["--temperature", "0.7"]
    main([*sampled, "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "5"])
    assert "sampled at temperature 0.7, top_p 1.0, trees of steps 3, topk 2" in capsys.readouterr().out

    main([*common, "--sweep", "--out", str(tmp_path / "sweep")])
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [(r["num_steps"], r["topk"], r["num_draft_tokens"]) for r in rows] == [
        (3, 1, 4),
        (5, 1, 6),
        (3, 4, 8),
        (5, 4, 8),
        (5, 4, 16),
        (5, 8, 32),
    ]
    assert "| 5 | 8 | 32 |" in printed and (tmp_path / "sweep" / "sweep.md").read_text().count("\n| ") == 7
    for row in rows:
        assert row["lossless"] is True and row["draft_tokens_per_round"] == row["num_draft_tokens"] - 1
        if row["topk"] == 1:
            chain = evaluate_export(
                export,
                perfect_prompts(module)[:2],
                target=module.target,
                max_new_tokens=8,
                stop_token_ids=(),
                num_steps=row["num_steps"],
                with_training_estimate=False,
            )
            assert row["accept_len_pooled"] == chain.served.accept_len
            assert row["accept_len_per_request"] == chain.served.accept_len_per_request


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--topk", "2"], "tree drafting needs both"),
        (["--sweep", "--topk", "2"], "--sweep serves its own grid of tree settings; drop --topk"),
        (["--topk", "2", "--num-draft-tokens", "40", "--num-steps", "2"], r"num_draft_tokens = 40"),
    ],
)
def test_cli_evaluate_refuses_incomplete_tree_settings(options, message, tmp_path, capsys):
    module = perfect_module(Eagle3Module, "llama")
    export = module.export(tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(perfect_prompts(module)[0].tolist()))
    repeating_target("llama").save_pretrained(tmp_path / "target")
    with pytest.raises(SystemExit) as raised:
        main(
            [
                "evaluate",
                str(export),
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "2",
                "--no-card",
                "--target",
                str(tmp_path / "target"),
                *options,
            ]
        )
    assert raised.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_evaluate_counts_the_prompts_it_cuts_and_refuses_a_decode_past_the_targets_positions(
    tmp_path, capsys, caplog
):
    export = eagle3_export(TINY_TARGETS["llama"], tmp_path / "draft")
    long_prompts = [list(range(1, 4)), list(range(1, 11)), list(range(1, 21))]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in long_prompts))
    out = tmp_path / "report.json"
    with caplog.at_level(logging.INFO):
        main(
            ["evaluate", str(export), "--prompts", str(prompts), "--max-prompt-tokens", "8"]
            + ["--max-new-tokens", "2", "--no-training-estimate", "--no-baseline", "--no-card"]
            + ["--json", str(out)]
        )
    logged = [r.getMessage() for r in caplog.records]
    # The file holds 3 prompts (fewer than the default --num-prompts): the true count is said.
    assert "evaluate: 3 prompts from " + str(prompts) in logged, logged
    assert (
        "evaluate: 2 of 3 prompts were longer than max_prompt_tokens=8 and were served with their last 8 "
        "tokens only; raise the limit with --max-prompt-tokens"
    ) in logged
    served = json.loads(out.read_text())["prompts"]
    assert served == [long_prompts[0], long_prompts[1][-8:], long_prompts[2][-8:]]
    capsys.readouterr()

    # 8 prompt tokens + 250 new - 1 + 3 proposed = 260 positions, past the tiny Llama's 256.
    assert TINY_TARGETS["llama"]["max_position_embeddings"] == 256 and STEPS == 3
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["evaluate", str(export), "--prompts", str(prompts), "--max-prompt-tokens", "8"]
            + ["--max-new-tokens", "250", "--no-training-estimate", "--no-baseline", "--no-card"]
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()
    assert error[0] == (
        "lightning-drafts evaluate: error: prompt 2 of 3 has 8 tokens: with max_new_tokens=250 and "
        "num_steps=3 the target would run over 260 positions, past its max_position_embeddings=256; lower "
        "--max-new-tokens or --max-prompt-tokens"
    )


def test_a_smaller_evaluate_run_never_replaces_the_cards_measurement(tmp_path, capsys):
    export = eagle3_export(TINY_TARGETS["llama"], tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(list(range(1, n))) for n in (4, 6, 8)))
    card = tmp_path / "draft" / "README.md"

    def evaluate(num_prompts: int, new_tokens: int) -> str:
        main(
            ["evaluate", str(export), "--prompts", str(prompts), "--num-prompts", str(num_prompts)]
            + ["--max-new-tokens", str(new_tokens), "--ignore-eos", "--no-training-estimate", "--no-baseline"]
        )
        return capsys.readouterr().out.splitlines()[-1]

    def served(text: str) -> list[str]:
        section = text.split("<!-- lightning-drafts: served results -->")[1]
        return re.findall(r"\| prompts \| (\d+) from", section)

    said = evaluate(3, 4)
    assert said.startswith("updated ") and "(3 prompts, 12 tokens)" in said
    measured = card.read_text()
    # A throw-away run on one prompt: the 3-prompt measurement stays first, the small run beside it.
    said = evaluate(1, 4)
    assert said.startswith("kept the served acceptance") and "measured on 3 prompts, 12 tokens" in said
    text = card.read_text()
    assert served(text) == ["3", "1"]
    assert text.split("### A later, smaller run")[0] == measured.split("<!-- /lightning-drafts")[0] + "\n"
    assert "### A later, smaller run (1 prompts, 4 tokens)" in text
    # As many prompts but fewer tokens is smaller too; a second small run replaces the first one beside.
    evaluate(3, 2)
    assert served(card.read_text()) == ["3", "3"]
    # At least as many prompts and tokens: it replaces both.
    said = evaluate(3, 5)
    assert said.startswith("updated ") and served(card.read_text()) == ["3"]
    assert "smaller run" not in card.read_text()


def test_evaluate_with_another_target_than_the_drafts_names_both_targets(tmp_path, capsys):
    export = eagle3_export(TINY_TARGETS["llama"], tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(random_docs([4], vocab=96, seed=5)[0].tolist()))
    for given, named in [
        ("shipped:tiny-qwen3", "shipped:tiny-qwen3"),
        # A config of the same model type and depth, another width: named by its sizes.
        (
            json.dumps({**TINY_TARGETS["llama"], "hidden_size": 48}),
            "a llama config (hidden_size 48, 8 layers",
        ),
    ]:
        target = tmp_path / "other.json"
        target.write_text(given)
        argument = given if given.startswith("shipped:") else str(target)
        with pytest.raises(SystemExit) as exit_:
            main(
                [
                    "evaluate",
                    str(export),
                    "--target",
                    argument,
                    "--prompts",
                    str(prompts),
                    "--num-prompts",
                    "1",
                ]
            )
        assert exit_.value.code == 2
        (line,) = [
            line for line in capsys.readouterr().err.splitlines() if line.startswith("lightning-drafts ")
        ]
        assert line.startswith(
            f"lightning-drafts evaluate: error: {export} was trained for a llama config (hidden_size 32, 8 "
            f"layers, vocab_size 96), but the target given is {named}"
        ), line
