"""`regenerate`: the target's own answers, turn by turn, resumable and split across workers, and the data
match check that tells a fit whether its answers are the target's."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_drafts.callbacks import DataMatchCallback
from lightning_drafts.cli.main import main as cli_main
from lightning_drafts.cli.main import run_cli
from lightning_drafts.core.output_lock import OutputInUse
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.chat_format import read_conversation
from lightning_drafts.serving.decode import greedy_generate
from lightning_drafts.serving.generate import AnswerSampling, Request, TransformersEngine
from lightning_drafts.serving.vllm_engine import VLLMRunError
from lightning_drafts.training.data_match import DataMatch, target_match
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.regenerate import (
    RegenerateOptions,
    merge_shards,
    metadata_path,
    regenerate,
    shard_path,
)
from tests.support.chat_templates import AGENT, HELLO, supervised_runs, template
from tests.support.lock_holder import held_by_another_process

ROOT = Path(__file__).resolve().parents[2]
TARGET = "shipped:tiny-llama"
CONVERSATIONS = [
    [("user", "Hello! How are you today?"), ("assistant", "Fine, thanks.")],
    [("system", "Be brief."), ("user", "What do you like to do?"), ("assistant", "Reading.")],
    [("user", "I just got back from a trip"), ("assistant", "Where to?"), ("user", "The mountains"),
     ("assistant", "Nice!")],
    [("user", "Do you have any pets?"), ("assistant", "No.")],
    [("user", "   "), ("assistant", "You said nothing.")],  # an empty user turn: counted, not written
    [("user", "What is your favourite food?"), ("assistant", "Pizza.")],
    [("user", "Tell me about your weekend"), ("assistant", "It was quiet."), ("user", "Why?"),
     ("assistant", "Rain.")],
]  # fmt: skip


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return FrozenTarget(TARGET)


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": r, "content": c} for r, c in turns]} for turns in CONVERSATIONS]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def data(files: Path, tmp_path: Path, **kwargs) -> PackedChatDataModule:
    options = {"tokenizer": TARGET, "max_tokens": 256, "cache_dir": str(tmp_path / "cache"), **kwargs}
    return PackedChatDataModule(data_files=str(files), **options)


def engine(target: FrozenTarget, datamodule: PackedChatDataModule) -> TransformersEngine:
    return TransformersEngine(target.model, datamodule.pad_token_id, [datamodule.tokenizer.eos_token_id])


OPTIONS = RegenerateOptions(AnswerSampling(max_new_tokens=12), batch_size=2)


def test_batched_greedy_generation_equals_the_targets_own_greedy_decode(target, chats, tmp_path):
    """Left-padded batches of prompts of different lengths (transformers' generate with its KV cache)
    give each prompt exactly the target's cache-free greedy decode."""
    tokenizer = data(chats, tmp_path).tokenizer
    prompts = [
        tokenizer(text, add_special_tokens=False).input_ids for text in ("Hi", "How was your day today?")
    ]
    prompts.append(prompts[1][:3])
    generated = engine(target, data(chats, tmp_path))(
        [Request(p, 0) for p in prompts], AnswerSampling(max_new_tokens=10)
    )
    eos = tokenizer.eos_token_id
    for prompt, tokens in zip(prompts, generated, strict=True):
        reference = greedy_generate(target, torch.tensor(prompt), 10, stop_token_ids=[eos])
        assert tokens == [t for t in reference if t != eos]


def test_regenerated_answers_are_the_targets_turn_by_turn(target, chats, tmp_path):
    datamodule = data(chats, tmp_path)
    output = tmp_path / "answers.jsonl"
    with pytest.warns(
        UserWarning, match=r"1 conversation\(s\) were not regenerated \({'empty user turn': 1}\)"
    ):
        meta = regenerate(datamodule, engine(target, datamodule), output, OPTIONS, progress=False)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["source_row"] for row in rows] == [0, 1, 2, 3, 5, 6]
    assert meta["counts"]["skipped_rows"] == [{"row": 4, "reason": "empty user turn"}]
    assert meta["counts"]["assistant_turns"] == 8 and meta["finished"]
    for row in rows:
        original = CONVERSATIONS[row["source_row"]]
        # System and user turns kept, every assistant turn replaced by the target's continuation of the
        # regenerated conversation before it.
        assert [m["role"] for m in row["messages"]] == [role for role, _ in original]
        for position, (role, content) in enumerate(original):
            if role != "assistant":
                assert row["messages"][position]["content"] == content
                continue
            prompt = datamodule.tokenizer.apply_chat_template(
                row["messages"][:position], add_generation_prompt=True, tokenize=False
            )
            ids = torch.tensor(datamodule.tokenizer(prompt, add_special_tokens=False).input_ids)
            expected = greedy_generate(target, ids, 12, stop_token_ids=[datamodule.tokenizer.eos_token_id])
            text = datamodule.tokenizer.decode(
                [t for t in expected if t != datamodule.tokenizer.eos_token_id]
            )
            assert row["messages"][position]["content"] == text


def test_an_agent_conversation_keeps_its_calls_and_results_and_regenerates_its_answers(tmp_path):
    """Qwen3's published template (tools in its system block, calls as <tool_call> JSON) on the tiny Qwen3
    target: the turn calling a tool and the tool's result are written as recorded, each text answer is the
    target's greedy continuation of the conversation so far rendered with the row's tools (transformers'
    own ``apply_chat_template`` as the reference), and the file reads back through the fit data path with
    the call supervised and the result not."""
    target = FrozenTarget("shipped:tiny-qwen3")
    files = tmp_path / "agent.jsonl"
    files.write_text(json.dumps(AGENT) + "\n" + json.dumps(HELLO) + "\n")
    options = {"tokenizer": "shipped:tiny-qwen3", "chat_template": template("qwen3"), "max_tokens": 1024}
    datamodule = data(files, tmp_path, **options)
    tokenizer, eos = datamodule.tokenizer, datamodule.tokenizer.eos_token_id
    prompts = []

    def recording(requests, sampling):
        prompts.extend(tokenizer.decode(request.prompt) for request in requests)
        return engine(target, datamodule)(requests, sampling)

    output = tmp_path / "answers.jsonl"
    meta = regenerate(datamodule, recording, output, OPTIONS, progress=False)
    counts = meta["counts"]
    assert (counts["tool_call_turns_kept"], counts["tool_results_kept"]) == (1, 1)
    assert (
        counts["assistant_turns"] == 3
        and counts["skipped"] == {}
        and meta["settings"]["tool_calls"] == "keep"
    )
    agent, hello = (json.loads(line) for line in output.read_text().splitlines())
    assert agent["tools"] == AGENT["tools"] and "tools" not in hello
    recorded = dict(datamodule.conversation_rows())[0].messages
    messages = agent["messages"]
    assert [m["role"] for m in messages] == [m["role"] for m in AGENT["messages"]]
    assert messages[:4] == recorded[:4] and messages[5] == recorded[5]  # the call and its result as recorded
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    for position in (4, 6):
        prompt = tokenizer.apply_chat_template(
            messages[:position],
            tools=AGENT["tools"],
            chat_template=template("qwen3"),
            add_generation_prompt=True,
            tokenize=False,
        )
        assert "Weather of a city" in prompt and "18 C, sunny" in prompt
        ids = torch.tensor(tokenizer(prompt, add_special_tokens=False).input_ids)
        expected = greedy_generate(target, ids, 12, stop_token_ids=[eos])
        assert messages[position] == {
            "role": "assistant",
            "content": tokenizer.decode([t for t in expected if t != eos]),
        }
    # Turn k of every conversation goes together: the agent's first answer and the greeting's, then the
    # agent's second; only the agent's prompts hold tool definitions.
    assert ["Weather of a city" in prompt for prompt in prompts] == [True, False, True], prompts

    # Through the fit data path: the call (with its reasoning) and the answers supervised, the result not.
    module = data(output, tmp_path / "read", setup_summary=False, val_fraction=0.0, **options)
    module.setup("fit")
    assert (module.stats["train"]["tool_calls"], module.stats["train"]["tool_results"]) == (1, 1)
    runs = [run for i in range(len(module.train_documents)) for run in supervised_runs(module, i)]
    assert any("<tool_call>" in run and '"city": "Paris"' in run for run in runs), runs
    assert not any("18 C, sunny" in run for run in runs), runs
    answers = [messages[4]["content"], messages[6]["content"], hello["messages"][1]["content"]]
    assert all(any(answer in run for run in runs) for answer in answers), (answers, runs)


def test_a_sharegpt_agent_row_is_written_back_as_sharegpt_with_the_answers_of_its_openai_copy(tmp_path):
    """The same agent conversation as a LLaMA-Factory ShareGPT row (tools as a JSON string, the call as a
    ``function_call`` turn, its result as ``observation``) and as an OpenAI row: each is written back in its
    own format, the ShareGPT row's recorded turns character for character, and both read back as the same
    conversation (the OpenAI path's answers are checked against transformers in the test above)."""
    target = FrozenTarget("shipped:tiny-qwen3")
    openai = {"tools": AGENT["tools"], "messages": [dict(m) for m in AGENT["messages"][:5]]}
    # A function_call turn holds its call alone: no reasoning, no call id.
    openai["messages"][2] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": AGENT["messages"][2]["tool_calls"][0]["function"]}],
    }
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    sharegpt = {
        "tools": json.dumps(AGENT["tools"]),
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": call},
            {"from": "observation", "value": "18 C, sunny", "tool_call_id": "call1"},
            {"from": "gpt", "value": "It is 18 C and sunny."},
        ],
    }
    options = {"tokenizer": "shipped:tiny-qwen3", "chat_template": template("qwen3"), "max_tokens": 1024}
    written = {}
    for name, row in (("openai", openai), ("sharegpt", sharegpt)):
        files = tmp_path / f"{name}.jsonl"
        files.write_text(json.dumps(row) + "\n")
        datamodule = data(files, tmp_path / name, **options)
        output = tmp_path / f"{name}.out.jsonl"
        regenerate(datamodule, engine(target, datamodule), output, OPTIONS, progress=False)
        (written[name],) = (json.loads(line) for line in output.read_text().splitlines())
    assert set(written["sharegpt"]) == {"conversations", "tools", "source_row"}
    assert written["sharegpt"]["tools"] == sharegpt["tools"]
    turns = written["sharegpt"]["conversations"]
    assert turns[:4] == sharegpt["conversations"][:4] and turns[4]["from"] == "gpt"
    assert turns[4]["value"] == written["openai"]["messages"][4]["content"] != "It is 18 C and sunny."
    assert read_conversation(written["sharegpt"]).messages == read_conversation(written["openai"]).messages


def test_tool_calls_skip_leaves_agent_conversations_out_counted(target, tmp_path):
    files = tmp_path / "agent.jsonl"
    files.write_text(json.dumps(HELLO) + "\n" + json.dumps(AGENT) + "\n")
    datamodule = data(files, tmp_path, chat_template=template("qwen3"))
    options = RegenerateOptions(AnswerSampling(max_new_tokens=4), batch_size=2, tool_calls="skip")
    with pytest.warns(UserWarning, match=r"\{\"tool calls \(tool_calls='skip'\)\": 1\}"):
        meta = regenerate(
            datamodule, engine(target, datamodule), tmp_path / "out.jsonl", options, progress=False
        )
    assert meta["counts"]["skipped_rows"] == [{"row": 1, "reason": "tool calls (tool_calls='skip')"}]
    assert meta["counts"]["rows_written"] == 1 and meta["counts"]["tool_call_turns_kept"] == 0
    with pytest.raises(ValueError, match=r"tool_calls = 'run'; choose one of \('keep', 'skip'\)"):
        RegenerateOptions(tool_calls="run")


def test_a_killed_run_resumes_to_the_same_file_and_two_workers_give_the_same_rows(
    target, chats, tmp_path, caplog
):
    datamodule = data(chats, tmp_path)
    whole = tmp_path / "whole.jsonl"
    with pytest.warns(UserWarning):
        regenerate(datamodule, engine(target, datamodule), whole, OPTIONS, progress=False)

    calls = 0

    def dies_on_the_third_batch(requests, sampling):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return engine(target, datamodule)(requests, sampling)

    killed = tmp_path / "killed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(datamodule, dies_on_the_third_batch, killed, OPTIONS, progress=False)
    with killed.open("a") as out:
        out.write('{"messages": [{"role": "user", "conte')  # a line cut by the kill
    assert json.loads(metadata_path(killed).read_text())["finished"] is False
    with pytest.raises(FileExistsError, match="pass --resume to continue it or --overwrite"):
        regenerate(datamodule, engine(target, datamodule), killed, OPTIONS, progress=False)
    with pytest.raises(ValueError, match="settings differ"):
        regenerate(
            datamodule, engine(target, datamodule), killed, RegenerateOptions(batch_size=3), resume=True
        )
    stopped_at = json.loads(metadata_path(killed).read_text())["next_batch"]
    with pytest.warns(UserWarning), caplog.at_level(logging.INFO):
        regenerate(datamodule, engine(target, datamodule), killed, OPTIONS, resume=True, progress=False)
    assert killed.read_text() == whole.read_text()
    # The resumed run says where it resumed: the batches written before the kill are kept.
    batches = -(-len(list(datamodule.conversations())) // OPTIONS.batch_size)
    resumed = (
        rf"resuming {re.escape(str(killed))} at batch {stopped_at} of {batches}: \d+ rows were written .*"
    )
    assert stopped_at > 0 and any(re.fullmatch(resumed, r.getMessage()) for r in caplog.records)

    # Killed while its first batch decodes: nothing written yet, and the resume starts from the beginning.
    def dies_at_once(requests, sampling):
        raise KeyboardInterrupt

    early = tmp_path / "early.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(datamodule, dies_at_once, early, OPTIONS, progress=False)
    assert early.read_text() == "" and json.loads(metadata_path(early).read_text())["next_batch"] == 0
    with pytest.warns(UserWarning):
        regenerate(datamodule, engine(target, datamodule), early, OPTIONS, resume=True, progress=False)
    assert early.read_text() == whole.read_text()

    for worker in range(2):
        regenerate(
            datamodule, engine(target, datamodule), shard_path(tmp_path / "split.jsonl", worker, 2), OPTIONS,
            worker=(worker, 2), progress=False,
        )  # fmt: skip
    merged = merge_shards(tmp_path / "split.jsonl", 2)
    assert (tmp_path / "split.jsonl").read_text() == whole.read_text()
    assert merged["counts"] == json.loads(metadata_path(whole).read_text())["counts"]


def test_a_run_logs_its_progress_and_a_second_writer_of_its_output_is_refused(
    target, chats, tmp_path, caplog
):
    datamodule = data(chats, tmp_path)
    output = tmp_path / "answers.jsonl"
    with held_by_another_process(output) as holder:
        with pytest.raises(
            OutputInUse, match=rf"answers.jsonl is being written by another run \(process {holder.pid} "
        ):
            regenerate(datamodule, engine(target, datamodule), output, OPTIONS)
    assert not output.exists()
    with pytest.warns(UserWarning), caplog.at_level(logging.INFO):
        regenerate(datamodule, engine(target, datamodule), output, OPTIONS)  # progress on, stderr no terminal
    total = len(list(datamodule.conversations()))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerate: ")]
    assert lines[0] == f"regenerate: {total} conversations"
    assert lines[1].startswith(f"regenerate: {OPTIONS.batch_size}/{total} conversations (")
    assert re.fullmatch(
        rf"regenerate: {total}/{total} conversations \(100%\), [\d.]+ conversations/s, [\d.]+ tokens/s, 0 s left",
        lines[-1],
    )


def test_sampled_answers_depend_on_the_seed_not_on_the_batch(target, chats, tmp_path):
    datamodule = data(chats, tmp_path)
    runs = {}
    for name, batch_size, seed in (("a", 1, 5), ("b", 3, 5), ("c", 3, 6)):
        options = RegenerateOptions(
            AnswerSampling(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=seed), batch_size=batch_size
        )
        with pytest.warns(UserWarning):
            regenerate(
                datamodule, engine(target, datamodule), tmp_path / f"{name}.jsonl", options, progress=False
            )
        runs[name] = [
            json.loads(line)["messages"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()
        ]
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_bad_requests_are_refused_with_the_fix(target, chats, tmp_path):
    datamodule = data(chats, tmp_path)
    with pytest.raises(ValueError, match="no enable_thinking switch"):
        regenerate(
            datamodule, engine(target, datamodule), tmp_path / "t.jsonl", RegenerateOptions(thinking="on")
        )
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        regenerate(datamodule, engine(target, datamodule), tmp_path / "none.jsonl", OPTIONS, resume=True)
    with pytest.raises(ValueError, match="temperature = -1"):
        AnswerSampling(temperature=-1)
    with pytest.raises(ValueError, match=r"worker = \(2, 2\)"):
        regenerate(datamodule, engine(target, datamodule), tmp_path / "w.jsonl", OPTIONS, worker=(2, 2))
    short = RegenerateOptions(AnswerSampling(max_new_tokens=4), max_prompt_tokens=12)
    with pytest.warns(UserWarning, match="prompt longer than max_prompt_tokens=12"):
        meta = regenerate(datamodule, engine(target, datamodule), tmp_path / "s.jsonl", short, progress=False)
    assert meta["counts"]["skipped"]["prompt longer than max_prompt_tokens=12"] >= 1
    with pytest.raises(
        ValueError, match="context_tokens = 8 leaves no room for a prompt with max_new_tokens = 8"
    ):
        RegenerateOptions(AnswerSampling(max_new_tokens=8), context_tokens=8)


def test_a_turn_that_does_not_fit_the_targets_context_is_counted_not_generated(target, chats, tmp_path):
    """A serving engine refuses a prompt whose generation would pass the target's context: such a row is
    not regenerated, and counted with the reason."""
    datamodule = data(chats, tmp_path)
    tokenizer = datamodule.tokenizer
    prompts = []  # the first turn's prompt length of every answerable conversation
    for _, messages in datamodule.conversations():
        if all(m["content"].strip() for m in messages):
            first = messages[: [m["role"] for m in messages].index("assistant")]
            text = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
            prompts.append(len(tokenizer(text, add_special_tokens=False).input_ids))
    context = min(prompts) + 4 + 1  # room for the shortest first turn and 4 new tokens, not for the longer
    options = RegenerateOptions(AnswerSampling(max_new_tokens=4), context_tokens=context)
    reason = f"prompt + max_new_tokens=4 longer than the target's context ({context} tokens)"
    with pytest.warns(UserWarning, match=re.escape(reason)):
        meta = regenerate(
            datamodule, engine(target, datamodule), tmp_path / "c.jsonl", options, progress=False
        )
    too_long = sum(length > context - 4 for length in prompts)
    assert 0 < too_long < len(prompts)
    assert meta["counts"]["skipped"][reason] >= too_long
    assert all(
        len(row["messages"]) for row in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines())
    )


def test_a_conversation_ends_at_the_first_turn_past_max_conversation_tokens(target, chats, tmp_path):
    """Turns whose prompt already holds max_conversation_tokens (where training truncates) are not
    generated: the row keeps the turns before, as the unbounded run wrote them, and is counted."""
    datamodule = data(chats, tmp_path)
    options = RegenerateOptions(AnswerSampling(max_new_tokens=4), batch_size=3)
    with pytest.warns(UserWarning):
        regenerate(datamodule, engine(target, datamodule), tmp_path / "all.jsonl", options, progress=False)
    full = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    tokenizer = datamodule.tokenizer
    first_prompts = []
    for row in full:
        first = row["messages"][: [m["role"] for m in row["messages"]].index("assistant")]
        text = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
        first_prompts.append(len(tokenizer(text, add_special_tokens=False).input_ids))
    bound = max(first_prompts) + 1  # every first turn fits; every second turn's prompt is longer
    bounded = RegenerateOptions(AnswerSampling(max_new_tokens=4), batch_size=3, max_conversation_tokens=bound)
    with pytest.warns(UserWarning):
        meta = regenerate(
            datamodule, engine(target, datamodule), tmp_path / "b.jsonl", bounded, progress=False
        )
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    multi_turn = [r["source_row"] for r in full if sum(m["role"] == "assistant" for m in r["messages"]) > 1]
    assert multi_turn == [2, 6]
    assert meta["counts"]["ended_early"] == {f"prompt reached max_conversation_tokens={bound}": 2}
    for whole, cut in zip(full, rows, strict=True):
        assert cut["source_row"] == whole["source_row"]
        keep = [m["role"] for m in whole["messages"]].index("assistant") + 1
        expected = whole["messages"][:keep] if whole["source_row"] in multi_turn else whole["messages"]
        assert cut["messages"] == expected
    with pytest.raises(ValueError, match="max_conversation_tokens = 0; it must be >= 1"):
        RegenerateOptions(max_conversation_tokens=0)


def test_the_data_match_is_total_on_regenerated_answers_and_fit_logs_it(target, chats, tmp_path):
    datamodule = data(chats, tmp_path)
    output = tmp_path / "answers.jsonl"
    # Room for every turn to end where the target ends it (a turn cut at max_new_tokens gets an end of turn
    # the target did not choose, and is counted).
    options = RegenerateOptions(AnswerSampling(max_new_tokens=64), batch_size=4)
    with pytest.warns(UserWarning):
        meta = regenerate(datamodule, engine(target, datamodule), output, options, progress=False)
    assert meta["counts"]["turns_cut_at_max_new_tokens"] == 0
    datamodule.setup("fit")
    original = target_match(target, datamodule.train_documents, num_documents=16)
    regenerated = data(output, tmp_path)
    regenerated.setup("fit")
    own = target_match(target, regenerated.train_documents, num_documents=16)
    assert own.share == 1.0 and own.supervised > 20
    assert original.share < 0.8

    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    cli = run_cli(
        [
            "fit",
            f"--config={config}",
            f"--data.init_args.data_files={output}",
            "--data.init_args.val_fraction=0",
            f"--data.init_args.cache_dir={tmp_path / 'cache'}",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ]
    )
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, DataMatchCallback)]
    assert callback.result.share == 1.0
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    assert [e.value for e in events.Scalars("data/target_match")] == [1.0]


def test_the_cli_regenerates_checks_and_refuses_an_existing_output(chats, tmp_path, capsys):
    config = tmp_path / "fit.yaml"
    config.write_text(
        "model:\n  class_path: lightning_drafts.Eagle3Module\n  init_args:\n    target: shipped:tiny-llama\n"
        f"data:\n  class_path: lightning_drafts.datamodules.PackedChatDataModule\n  init_args:\n"
        f"    data_files: {chats}\n    tokenizer: shipped:tiny-llama\n    max_tokens: 256\n"
    )
    output = tmp_path / "cli.jsonl"
    common = [f"--config={config}", f"--cache-dir={tmp_path / 'cache'}"]
    cli_main(["regenerate", *common, f"--output={output}", "--max-new-tokens=8", "--limit=3"])
    assert "wrote" in capsys.readouterr().out
    assert len(output.read_text().splitlines()) == 3
    with pytest.raises(SystemExit):
        cli_main(["regenerate", *common, f"--output={output}"])
    assert "regenerate: error: " in capsys.readouterr().err  # the message alone
    with pytest.raises(FileExistsError, match="--resume"):
        cli_main(["regenerate", *common, f"--output={output}", "--debug"])
    cli_main(["regenerate", *common, "--check=4"])
    assert "data match: " in capsys.readouterr().out


def test_vllm_regenerates_the_same_answers_as_the_transformers_engine(target, chats, tmp_path):
    """A real vLLM engine (its own environment, built by .ci/vllm-env) writes the same file, token for
    token, as the built-in engine at temperature 0."""
    from lightning_drafts.serving.generate import VLLMEngine
    from lightning_drafts.shipped import resolve_shipped
    from tests.support.vllm_subprocess import vllm_python

    datamodule = data(chats, tmp_path)
    options = RegenerateOptions(AnswerSampling(max_new_tokens=12), batch_size=len(CONVERSATIONS))
    eos = [datamodule.tokenizer.eos_token_id]
    files = {name: tmp_path / f"{name}.jsonl" for name in ("transformers", "vllm")}
    with VLLMEngine(resolve_shipped(TARGET), eos, vllm_python()) as vllm:
        for name, generator in (("transformers", engine(target, datamodule)), ("vllm", vllm)):
            with pytest.warns(UserWarning, match="empty user turn"):
                regenerate(datamodule, generator, files[name], options, progress=False)
    assert files["vllm"].read_text() == files["transformers"].read_text()


def test_vllm_sampled_answers_depend_on_the_seed_not_on_the_batch(chats, tmp_path):
    """Sampled turns under vLLM: one engine for the whole run, each turn drawn by vLLM's own generator
    under the turn's seed, so the file does not depend on how rows were batched."""
    from lightning_drafts.serving.generate import VLLMEngine
    from lightning_drafts.shipped import resolve_shipped
    from tests.support.vllm_subprocess import vllm_python

    datamodule = data(chats, tmp_path)
    eos = [datamodule.tokenizer.eos_token_id]
    runs = {}
    with VLLMEngine(resolve_shipped(TARGET), eos, vllm_python()) as vllm:
        for name, batch_size, seed in (("a", 1, 5), ("b", 4, 5), ("c", 4, 6)):
            options = RegenerateOptions(
                AnswerSampling(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=seed),
                batch_size=batch_size,
            )
            with pytest.warns(UserWarning, match="empty user turn"):
                regenerate(datamodule, vllm, tmp_path / f"{name}.jsonl", options, progress=False)
            runs[name] = (tmp_path / f"{name}.jsonl").read_text()
        # A call vLLM refuses (a prompt past the target's context) is raised with vLLM's own reason.
        with pytest.raises(VLLMRunError, match="maximum context length"):
            vllm([Request([1] * 5000, 0)], AnswerSampling(max_new_tokens=4))
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_the_data_match_refuses_bad_settings(target, chats, tmp_path):
    assert DataMatch(0, 0, 3).describe() == (
        "no supervised token in 3 training documents to compare with the target"
    )
    with pytest.raises(ValueError, match=r"num_documents = -1; it must be >= 0 \(0 turns the check off\)"):
        DataMatchCallback(num_documents=-1)
    with pytest.raises(ValueError, match=r"warn_below = 2; it must be a share in \[0, 1\]"):
        DataMatchCallback(warn_below=2)
    datamodule = data(chats, tmp_path)
    datamodule.setup("fit")
    with pytest.raises(ValueError, match="num_documents = 0; it must be >= 1"):
        target_match(target, datamodule.train_documents, num_documents=0)
