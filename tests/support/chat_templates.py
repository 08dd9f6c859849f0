"""Published chat templates (tests/fixtures/chat_templates) with tokenizers that know their markers, and
the data module's documents read back as the runs of supervised text."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerFast

from lightning_drafts.datamodules import PackedChatDataModule

datasets.disable_progress_bars()

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "chat_templates"
# A byte-level BPE, so any text round-trips through tokens; each family adds its markers as special tokens.
BYTE_LEVEL = ROOT / "lightning_drafts" / "shipped" / "tiny-qwen3" / "tokenizer.json"

DEEPSEEK_MARKERS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
# (eos, bos, other markers) of each template's tokenizer, as the models' tokenizer configs name them.
FAMILIES = {
    "qwen3": (
        "<|im_end|>",
        None,
        [
            "<|im_start|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ],
    ),
    "llama3.1": (
        "<|eot_id|>",
        "<|begin_of_text|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>"],
    ),
    "deepseek-r1": ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", DEEPSEEK_MARKERS),
    "deepseek-v3.1": ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", DEEPSEEK_MARKERS),
    "smollm2": ("<|im_end|>", None, ["<|im_start|>"]),
    "gpt-oss": ("<|return|>", None, ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>"]),
    "mistral-nemo": (
        "</s>",
        "<s>",
        ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"],
    ),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

# An agent conversation: reasoning, a tool call, its result, an answer, then a second user query whose
# answer writes its reasoning as a <think> block inside the content.
AGENT = {
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny.", "reasoning_content": "The tool says 18 C."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "<think>Polite reply.</think>You are welcome."},
    ],
}
HELLO = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}


def template(name: str) -> str:
    return (FIXTURES / f"{name}.jinja").read_text()


def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    eos, bos, markers = FAMILIES[name]
    return PreTrainedTokenizerFast(
        tokenizer_file=str(BYTE_LEVEL), eos_token=eos, bos_token=bos, additional_special_tokens=markers
    )


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def set_up(rows: list[dict], tmp_path: Path, name: str, **kwargs) -> PackedChatDataModule:
    """The data module of ``rows`` rendered by template ``name``, set up as ``fit`` sets it up."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    module = PackedChatDataModule(
        data_files=write_jsonl(tmp_path / "rows.jsonl", rows),
        tokenizer=family_tokenizer(name),
        chat_template=template(name),
        max_tokens=1024,
        cache_dir=str(tmp_path / "cache"),
        setup_summary=False,
        **kwargs,
    )
    module.setup("fit")
    return module


def supervised_runs(module: PackedChatDataModule, index: int) -> list[str]:
    """The text of each run of consecutive supervised tokens of training document ``index``."""
    ids, mask = module.train_documents.tokens(index)
    runs, current = [], []
    for token, supervised in zip(ids.tolist(), mask.tolist(), strict=True):
        if supervised:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [module.tokenizer.decode(run) for run in runs]


def document_text(module: PackedChatDataModule, index: int) -> str:
    return module.tokenizer.decode(module.train_documents.tokens(index)[0].tolist())
