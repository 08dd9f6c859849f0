"""Supervision exactly where the target speaks, for each published chat template (tests/fixtures/
chat_templates): assistant text, tool calls and reasoning are supervised, system and user text and tool
results never, and a template that rewrites earlier turns gets one document per assistant turn.

Every expectation below is written by hand from the template's text: the runs of supervised tokens of
each training document the data module sets up, decoded.
"""

from __future__ import annotations

import pytest

from tests.support.chat_templates import AGENT, HELLO, WEATHER_TOOL, document_text, set_up, supervised_runs

QWEN3_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def all_runs(module) -> list[list[str]]:
    return [supervised_runs(module, i) for i in range(len(module.train_documents))]


def test_qwen3_one_document_per_turn_with_the_earlier_reasoning_removed(tmp_path):
    module = set_up([AGENT], tmp_path, "qwen3")
    # Qwen3 drops the reasoning of turns before the last user query: three documents, each the prompt
    # the engine sends for that turn plus the turn, only that turn supervised.
    assert all_runs(module) == [
        ["<think>\nI should call the tool.\n</think>\n\n" + QWEN3_CALL],
        ["<think>\nThe tool says 18 C.\n</think>\n\nIt is 18 C and sunny.<|im_end|>"],
        ["<think>\nPolite reply.\n</think>\n\nYou are welcome.<|im_end|>"],
    ]
    last = document_text(module, 2)
    assert "I should call the tool." not in last and "The tool says 18 C." not in last
    assert "<|im_start|>assistant\n" + QWEN3_CALL in last  # the earlier turn, its reasoning gone
    # The tool definitions reach the template's system block, unsupervised.
    assert '"name": "get_weather", "description": "Weather of a city"' in last
    counts = module.stats["train"]
    assert (counts["tool_calls"], counts["tool_results"], counts["reasoning_dropped"]) == (1, 1, 0)


def test_qwen3_reasoning_unsupervised_when_asked(tmp_path):
    module = set_up([AGENT], tmp_path, "qwen3", supervise_reasoning=False)
    assert all_runs(module) == [
        ["\n\n" + QWEN3_CALL],
        ["\n\nIt is 18 C and sunny.<|im_end|>"],
        ["\n\nYou are welcome.<|im_end|>"],
    ]
    counts = module.stats["train"]
    assert counts["reasoning_tokens"] > 0 and counts["reasoning_supervised"] == 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # Thinking on: the model writes the (empty) think block itself.
        ({}, ["<think>\n\n</think>\n\nHello.<|im_end|>"]),
        # Thinking off: the generation prompt holds the empty think block, so it is prompt.
        ({"enable_thinking": False}, ["Hello.<|im_end|>"]),
    ],
)
def test_qwen3_thinking_switch(kwargs, expected, tmp_path):
    module = set_up([HELLO], tmp_path, "qwen3", chat_template_kwargs=kwargs)
    assert all_runs(module) == [expected]
    assert document_text(module, 0).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n"
    )


def test_llama31_tool_call_supervised_and_ipython_result_not(tmp_path):
    module = set_up([AGENT], tmp_path, "llama3.1")
    # Llama 3.1 renders no reasoning_content (both turns' reasoning dropped) and keeps a <think> block of
    # the content as text; nothing is rewritten, so the row stays one document.
    assert all_runs(module) == [
        [
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            "It is 18 C and sunny.<|eot_id|>",
            "<think>Polite reply.</think>You are welcome.<|eot_id|>",
        ]
    ]
    text = document_text(module, 0)
    # The template writes a result through tojson (a string is iterable to Jinja), quotes and all.
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C, sunny"<|eot_id|>' in text
    assert module.stats["train"]["reasoning_dropped"] == 2


def test_deepseek_r1_drops_every_think_block(tmp_path):
    module = set_up([AGENT], tmp_path, "deepseek-r1")
    assert all_runs(module) == [
        [
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
            "It is 18 C and sunny.<｜end▁of▁sentence｜>",
            "You are welcome.<｜end▁of▁sentence｜>",
        ]
    ]
    text = document_text(module, 0)
    assert "<｜tool▁output▁begin｜>18 C, sunny<｜tool▁output▁end｜>" in text
    assert module.stats["train"]["reasoning_dropped"] == 3 and module.stats["train"]["reasoning_tokens"] == 0


def test_deepseek_v31_thinking_prompt_opens_the_think_block(tmp_path):
    module = set_up([AGENT], tmp_path, "deepseek-v3.1", chat_template_kwargs={"thinking": True})
    # The generation prompt ends in "<think>" and history renders "<think></think>": the target writes
    # "</think>" and the rest.
    assert all_runs(module) == [
        [
            '</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
            "It is 18 C and sunny.<｜end▁of▁sentence｜>",
            "</think>You are welcome.<｜end▁of▁sentence｜>",
        ]
    ]


def test_smollm2_default_system_prompt_is_prompt_and_the_turn_ends_at_im_end(tmp_path):
    module = set_up([HELLO], tmp_path, "smollm2")
    assert document_text(module, 0) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    # The newline the template writes after <|im_end|> comes after the target stops: not supervised.
    assert all_runs(module) == [["Hello.<|im_end|>"]]


TWO_QUERIES = {
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye.", "reasoning_content": "Farewell."},
    ]
}


def test_gpt_oss_analysis_channel_supervised_and_dropped_from_later_documents(tmp_path):
    module = set_up([TWO_QUERIES], tmp_path, "gpt-oss")
    # Harmony: the reasoning is the analysis message, the answer the final one; an earlier turn keeps
    # only its final message, so each turn is its own document.
    assert all_runs(module) == [
        [
            "<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|return|>"
        ],
        [
            "<|channel|>analysis<|message|>Farewell.<|end|><|start|>assistant<|channel|>final<|message|>Bye.<|return|>"
        ],
    ]
    later = document_text(module, 1)
    assert "Greet." not in later and "<|start|>assistant<|channel|>final<|message|>Hello.<|end|>" in later


@pytest.mark.parametrize(("name", "system"), [("gpt-oss", False), ("mistral-nemo", True)])
def test_a_template_that_rewrites_the_prompt_of_a_turn_is_refused_not_mis_masked(name, system, tmp_path):
    # gpt-oss shows a tool call's analysis until a final answer follows; Mistral Nemo shows the system
    # prompt only while the user turn is the last message. Training text would then differ from the
    # prompt served, which prefix rendering cannot recover: such rows are counted as malformed.
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    messages += [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call it.",
            "tool_calls": [
                {"id": "abc123def", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "abc123def", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C."},
    ]
    module = set_up([{"tools": [WEATHER_TOOL], "messages": messages}, TWO_QUERIES], tmp_path, name)
    (reason,) = module.stats["train"]["malformed_reasons"]
    assert reason.startswith("chat template renders turns inconsistently")
