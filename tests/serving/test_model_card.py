"""Every export carries a model card (README.md) that reads back: Hugging Face metadata, the draft's
settings, and the serving commands of that export by each engine's own rule; ``evaluate`` rewrites only
its results section; the validators ignore the card.

The quickstart's card from a real checkpoint (base model, steps, data, served acceptance equal to
``evaluate``'s report) is checked in ``tests/cli/test_command.py``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.export_files import CARD_FILE
from lightning_drafts.serving.model_card import (
    NO_RESULTS,
    RESULTS_BEGIN,
    RESULTS_END,
    has_card,
    read_card,
    update_results,
)
from lightning_drafts.workflows.export import export_module
from tests.families.cases import CASES
from tests.support.builders import TINY_TARGETS

# (module class name, layout, its card tag, vLLM method, SGLang algorithm or None, proposals from the
# module, SGLang's --speculative-num-draft-tokens from the proposals). Written from the engines' docs and
# sources: vLLM drafts num_speculative_tokens per round (EAGLE-3: the trained ttt_length; DFlash: the
# block's mask slots; DSpark: every slot); SGLang verifies the anchor / bonus token plus the proposals.
EXPECTED = [
    ("Eagle3Module", None, "eagle3", "eagle3", "EAGLE3", lambda m: m.hparams.ttt_length),
    ("MLAEagle3Module", None, "mlaeagle3", "eagle3", None, lambda m: m.hparams.ttt_length),
    ("DFlashModule", None, "dflash", "dflash", "DFLASH", lambda m: m.block_size - 1),
    ("DFlash2Module", None, "dflash2", "dflash", None, lambda m: m.block_size - 1),
    ("DSparkModule", "specforge", "dspark", "dspark", "DSPARK", lambda m: m.block_size),
    ("DSparkModule", "nemo", "dspark", "dspark", None, lambda m: m.block_size),
]
CASE_BY_NAME = {cls.__name__: case for cls, case in CASES.items()}
ROOT = Path(__file__).resolve().parents[2]


def commands(body: str) -> dict[str, list[str]]:
    """The card's ```bash blocks by the engine line above them."""
    found = {}
    for engine, command in re.findall(
        r"^(vLLM|SGLang):\n\n```bash\n(.*?)\n```", body, re.MULTILINE | re.DOTALL
    ):
        found[engine] = shlex.split(command)
    return found


@pytest.mark.parametrize(
    ("name", "layout", "tag", "method", "algorithm", "proposals"),
    EXPECTED,
    ids=[f"{e[0]}-{e[1]}" if e[1] else e[0] for e in EXPECTED],
)
def test_an_export_s_card_reads_back_with_its_serving_commands(
    name, layout, tag, method, algorithm, proposals, tmp_path
):
    case = CASE_BY_NAME[name]
    module = case.build(TINY_TARGETS[case.targets[0]])
    family = REGISTRY.for_module(module)
    export = export_module(module, tmp_path / "draft", layout=layout)
    family.validate(export, module.target)  # the card beside the files changes nothing the validator reads

    front, body = read_card(export)
    assert front["library_name"] == "lightning-drafts"
    assert front["tags"] == ["speculative-decoding", tag]
    assert "base_model" not in front  # a config-dict target has no hub id to name
    assert "license" not in front  # the user's to choose
    for setting, value in module.hparams.items():
        if setting not in ("target", "tokenizer_vocab_size", "pad_token_id", "token_frequencies") and not (
            setting.startswith("_")
        ):
            assert f"| `{setting}` | `{json.dumps(value, default=str)}` |" in body, setting
    assert "Exported from a module in memory" in body
    assert f"{RESULTS_BEGIN}\n{NO_RESULTS}\n{RESULTS_END}" in body

    served = commands(body)
    n = proposals(module)
    vllm = served["vLLM"]
    assert vllm[:3] == ["vllm", "serve", "TARGET_DIR"] and vllm[3] == "--speculative-config"
    assert json.loads(vllm[4]) == {
        "method": method,
        "model": "draft",
        "num_speculative_tokens": n,
    }
    if algorithm is None:
        assert "SGLang" not in served and "SGLang: this layout is not one SGLang loads." in body
        return
    sglang = served["SGLang"]
    options = dict(zip(sglang[3::2], sglang[4::2], strict=True))
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    assert options["--model"] == "TARGET_DIR"
    assert options["--speculative-algorithm"] == algorithm
    assert options["--speculative-draft-model-path"] == "draft"
    assert options["--speculative-num-draft-tokens"] == str(n + 1)
    if algorithm == "EAGLE3":
        assert options["--speculative-num-steps"] == str(n) and options["--speculative-eagle-topk"] == "1"


@pytest.mark.parametrize("kind", ["a local folder", "shipped", "a GGUF file", "a hub id"])
def test_a_cards_serve_commands_carry_no_path_of_the_training_machine(kind, tmp_path):
    # The export and a local target live under tmp_path (the shipped targets under the repository): the
    # commands, read on another machine or the hub, name the export by its folder and a local target by a
    # placeholder the card explains.
    case = CASE_BY_NAME["Eagle3Module"]
    module = case.build(TINY_TARGETS[case.targets[0]])
    target = {
        "a local folder": str(tmp_path / "models" / "llama-8b"),
        "shipped": "shipped:tiny-llama",
        "a GGUF file": str(tmp_path / "models" / "llama-8b.gguf"),
        "a hub id": "meta-llama/Llama-3.1-8B-Instruct",
    }[kind]
    module.hparams["target"] = target
    export = export_module(module, tmp_path / "exports" / "draft")
    # No path of this machine anywhere in the card; base_model names a hub id (or a shipped target) only.
    card = (export / CARD_FILE).read_text()
    assert str(tmp_path) not in card and str(ROOT) not in card
    assert read_card(export)[0].get("base_model") == (target if kind in ("a hub id", "shipped") else None)
    named = {"a local folder": "llama-8b", "a GGUF file": "llama-8b.gguf"}.get(kind, target)
    assert f"against the frozen target `{named}`" in card
    text = card.split("## Serve it", 1)[1].split("## Served acceptance", 1)[0]
    served = commands(read_card(export)[1])
    served_target = {
        "a local folder": "TARGET_DIR",
        "shipped": "TARGET_DIR",
        "a GGUF file": "llama-8b-hf",
        "a hub id": "meta-llama/Llama-3.1-8B-Instruct",
    }[kind]
    assert served["vLLM"][2] == served_target and json.loads(served["vLLM"][4])["model"] == "draft"
    options = dict(zip(served["SGLang"][3::2], served["SGLang"][4::2], strict=True))
    assert options["--model"] == served_target and options["--speculative-draft-model-path"] == "draft"
    if served_target != target:
        assert f"`{served_target}`: " in text  # the placeholder is explained


def test_evaluate_s_results_replace_only_the_results_section(tmp_path):
    case = CASE_BY_NAME["Eagle3Module"]
    module = case.build(TINY_TARGETS[case.targets[0]])
    export = export_module(module, tmp_path / "draft")
    before, front = (export / CARD_FILE).read_text(), read_card(export)[0]
    update_results(export, "| served `accept_len` | 1.500 |")
    once = (export / CARD_FILE).read_text()
    update_results(export, "| served `accept_len` | 2.250 |")
    twice = (export / CARD_FILE).read_text()
    assert once == before.replace(NO_RESULTS, "| served `accept_len` | 1.500 |")
    assert twice == before.replace(NO_RESULTS, "| served `accept_len` | 2.250 |")  # replaced, not appended
    assert read_card(export)[0] == front


def test_a_readme_that_is_not_a_card_is_left_alone(tmp_path):
    (tmp_path / CARD_FILE).write_text("# my notes\n")
    assert not has_card(tmp_path)
    with pytest.raises(ValueError, match="not a lightning-drafts model card"):
        update_results(tmp_path, "x")
    assert (tmp_path / CARD_FILE).read_text() == "# my notes\n"
    with pytest.raises(FileNotFoundError, match="has no README.md"):
        read_card(tmp_path / "nowhere")
