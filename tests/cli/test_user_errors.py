"""A mistake in an option, a value, a path or a config file prints one short message naming it, with no
traceback unless asked (--debug or LIGHTNING_DRAFTS_DEBUG=1); a bug keeps its traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_drafts.cli.main import main
from lightning_drafts.cli.user_errors import DEBUG_ENV
from lightning_drafts.serving.prompts import load_prompts_jsonl, prompts_from_datamodule

ROOT = Path(__file__).resolve().parents[2]
EAGLE3 = ROOT / "configs" / "quickstart" / "eagle3.yaml"


@pytest.fixture(autouse=True)
def _in_a_scratch_directory(tmp_path, monkeypatch):
    """The config's relative run directory (``runs/eagle3``) lands in the test's directory: a fit that gets
    as far as its logger would otherwise add a ``version_N`` to the checkout's runs, and the README's
    ``runs/eagle3/version_0`` would no longer be the user's own first run."""
    monkeypatch.chdir(tmp_path)


def console(monkeypatch, *args: str) -> None:
    """``lightning-drafts ARGS`` as the console script runs it (LightningCLI reads sys.argv)."""
    monkeypatch.setattr(sys, "argv", ["lightning-drafts", *args])
    main()


def fails(capsys, monkeypatch, *args: str) -> list[str]:
    """What the command writes to stderr besides Lightning's "Seed set" line; it must exit with status 2
    and print no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        console(monkeypatch, *args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.strip().splitlines() if not line.startswith("Seed set to")]


def fit(tmp_path: Path, *overrides: str) -> list[str]:
    return ["fit", f"--config={EAGLE3}", f"--data.init_args.cache_dir={tmp_path / 'cache'}", *overrides]


def test_a_bad_value_prints_its_own_message_alone(tmp_path, capsys, monkeypatch):
    lines = fails(capsys, monkeypatch, *fit(tmp_path, "--data.init_args.batch_size=0"))
    assert lines == [
        "lightning-drafts fit: error: batch_size=0 must be a positive integer",
        f"(add --debug, or set {DEBUG_ENV}=1, to see the traceback)",
    ]


def test_debug_or_the_environment_variable_gives_the_traceback(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
        console(monkeypatch, *fit(tmp_path, "--data.init_args.batch_size=0"), "--debug")
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
        console(monkeypatch, *fit(tmp_path, "--data.init_args.batch_size=0"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "--model.init_args.ttt_lenght=3",
            "model (lightning_drafts.Eagle3Module): Option 'ttt_lenght' is not accepted",
        ),
        ("--trainer.max_steps=abc", "trainer.max_steps: expected int. Got value: abc"),
        (
            "--model.init_args.ttt_length=many",
            "model.init_args.ttt_length (lightning_drafts.Eagle3Module): expected int. Got value: many",
        ),
        ("--trainer.max_stepz=3", "unrecognized arguments: --trainer.max_stepz=3"),
        (
            "--model.init_args.learning_rate=nan",
            "model.init_args.learning_rate (lightning_drafts.Eagle3Module): nan is not a finite number (YAML "
            "reads nan and inf as text, not floats); give a finite number",
        ),
        (
            "--model.init_args.learning_rate=-inf",
            "model.init_args.learning_rate (lightning_drafts.Eagle3Module): -inf is not a finite number (YAML "
            "reads nan and inf as text, not floats); give a finite number",
        ),
    ],
)
def test_a_bad_option_names_the_option_in_one_line(override, message, tmp_path, capsys, monkeypatch):
    assert fails(capsys, monkeypatch, *fit(tmp_path, override)) == [f"lightning-drafts fit: error: {message}"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--trainer.max_steps=0"],
            "trainer.max_steps = 0 trains nothing; set a positive number of steps (or -1 to train for "
            "trainer.max_epochs)",
        ),
        (
            ["--trainer.accumulate_grad_batches=0", "--trainer.max_steps=1"],
            "trainer.accumulate_grad_batches = 0; it must be a positive integer (1 steps the optimiser after "
            "every batch)",
        ),
        (
            ["--model.init_args.remote.address=ray://head:10001", "--trainer.max_steps=1"],
            "remote.address = 'ray://head:10001' names the Ray cluster of the target workers, but remote.workers "
            "= 0, so the target runs here and the address would be ignored; set remote.workers (e.g. 1), or "
            "drop remote.address",
        ),
    ],
)
def test_a_fit_that_would_do_nothing_or_ignore_an_option_is_refused_up_front(
    overrides, message, tmp_path, capsys, monkeypatch
):
    # (Capped at one step on a few documents: without the refusal the fit would run.)
    (line, _) = fails(capsys, monkeypatch, *fit(tmp_path, *overrides, "--data.init_args.max_documents=20"))
    assert line.startswith("lightning-drafts fit: error: ") and line.endswith(message)
    assert not (tmp_path / "cache").exists()  # refused before the data was read


def test_rows_longer_than_the_target_can_position_are_refused(tmp_path, capsys, monkeypatch):
    # The shipped tiny Llama declares max_position_embeddings = 2048.
    overrides = (
        "--data.init_args.max_tokens=4096",
        "--data.init_args.max_documents=20",
        "--trainer.max_steps=1",
    )
    lines = fails(capsys, monkeypatch, *fit(tmp_path, *overrides))
    assert [line for line in lines if "error" in line] == [
        (
            "lightning-drafts fit: error: max_tokens = 4096 is longer than the target's max_position_embeddings = "
            "2048: a document's tokens past position 2047 would be placed where the target has no position; set "
            "data.init_args.max_tokens to at most 2048"
        )
    ]


def test_a_missing_target_directory_is_named_as_one(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "no-such-model"
    (line, _) = fails(capsys, monkeypatch, *fit(tmp_path, f"--model.init_args.target={missing}"))
    assert line.startswith(
        f"lightning-drafts fit: error: no such directory: {missing} (a target or tokenizer"
    )
    (line, _) = fails(capsys, monkeypatch, *fit(tmp_path, "--data.init_args.tokenizer=./no-such-tokenizer"))
    assert "no such directory: ./no-such-tokenizer" in line


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys, monkeypatch):
    config = tmp_path / "broken.yaml"
    config.write_text("model:\n  class_path: lightning_drafts.Eagle3Module\n   init_args: [\n")
    (line, _) = fails(capsys, monkeypatch, "fit", f"--config={config}")
    assert line == (
        f"lightning-drafts fit: error: {config}:3:13: YAML syntax error: mapping values are not allowed here; "
        "fix the file there"
    )
    (line, _) = fails(capsys, monkeypatch, "evaluate", str(tmp_path), f"--config={config}")
    assert line.startswith(f"lightning-drafts evaluate: error: {config}:3:13: YAML syntax error")


def test_a_subcommand_option_error_is_one_line_not_the_usage(tmp_path, capsys, monkeypatch):
    (line,) = fails(capsys, monkeypatch, "evaluate", str(tmp_path), "--num-prompts", "0")
    assert line == (
        "lightning-drafts evaluate: error: argument --num-prompts: 0 is not a positive count; write an integer "
        ">= 1 (`lightning-drafts evaluate --help` lists the options)"
    )
    (line,) = fails(capsys, monkeypatch, "regenerate", "--config", str(EAGLE3), "--batch-size", "-1")
    assert "argument --batch-size: -1 is not a positive count" in line


def test_prompt_readers_refuse_a_limit_below_one(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2, 3]\n[4, 5]\n")
    assert [p.tolist() for p in load_prompts_jsonl(path, 1)] == [[1, 2, 3]]
    with pytest.raises(ValueError, match="limit = 0; it must be a positive int"):
        load_prompts_jsonl(path, 0)
    with pytest.raises(ValueError, match="limit = 0; it must be a positive int"):
        prompts_from_datamodule(object(), 0)


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(args: list[str]) -> None:
        raise TypeError("a bug, not a user's mistake")

    monkeypatch.setattr("lightning_drafts.cli.export.export_main", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["export", "a.ckpt", "out"])


def checkpoint_recording(tmp_path: Path, **changed) -> Path:
    """A checkpoint of the quickstart's EAGLE-3 draft whose recorded hyperparameters are ``changed`` (as a
    checkpoint of another version would record them; its digests match)."""
    import lightning
    import torch

    from lightning_drafts import Eagle3Module
    from lightning_drafts.training.checkpoint_integrity import record_digests

    module = Eagle3Module("shipped:tiny-llama", ttt_length=4, draft_vocab_size=64, token_frequencies=None)
    # What LightningCLI records with the hyperparameters, so the class is rebuilt from them.
    cli = {
        "_class_path": "lightning_drafts.Eagle3Module",
        "_instantiator": "lightning.pytorch.cli.instantiate_module",
    }
    hparams = {**module.hparams, **cli, **changed}
    checkpoint = {
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": module.state_dict(),
        "hparams_name": "kwargs",
    }
    module.on_save_checkpoint(checkpoint)
    checkpoint["hyper_parameters"] = hparams
    record_digests(checkpoint)
    path = tmp_path / "draft.ckpt"
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize(
    ("changed", "refused"),
    [
        ({"learning_rate": -1.0}, "learning_rate = -1.0; it must be a number > 0"),
        (
            {"retired_option": 1},
            "DraftModule.__init__() got an unexpected keyword argument 'retired_option'; it records an "
            "argument this version of the draft does not take, so it was written by another lightning-drafts "
            "version: load it with that version",
        ),
    ],
)
def test_hyperparameters_a_checkpoint_records_are_refused_naming_the_checkpoint(
    changed, refused, tmp_path, capsys, monkeypatch
):
    path = checkpoint_recording(tmp_path, **changed)
    named = f"{path}: the draft refuses the hyperparameters this checkpoint records: {refused}"
    line = fails(capsys, monkeypatch, "export", str(path), str(tmp_path / "export"))[-2]
    assert line == f"lightning-drafts export: error: {named}", line
    # A fit that resumes it compares the command line's hyperparameters with the checkpoint's first, and
    # refuses the first that differs (here the draft vocabulary), naming the checkpoint too.
    line = fails(capsys, monkeypatch, *fit(tmp_path, f"--ckpt_path={path}"))[-2]
    assert line.startswith("lightning-drafts fit: error: ") and f"the checkpoint {path}" in line, line


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_fit_without_a_config_says_to_pass_one(command, capsys, monkeypatch):
    (line,) = fails(capsys, monkeypatch, command, "--trainer.max_steps=3")
    assert line == (
        f"lightning-drafts {command}: error: no config: pass --config FILE, a fit config naming the model and "
        "the data (configs/quickstart/eagle3.yaml is one), or both --model and --data (missing: "
        f"{command}.data, {command}.model)"
    )


@pytest.mark.parametrize(
    ("old", "new"),
    [("target_workers", "workers"), ("target_address", "address"), ("target_cache_dir", "cache_dir")],
)
def test_a_target_worker_option_under_its_flat_name_is_refused_naming_the_remote_one(
    old, new, tmp_path, capsys, monkeypatch
):
    (line, _) = fails(capsys, monkeypatch, *fit(tmp_path, f"--model.init_args.{old}=2"))
    assert line == (
        f"lightning-drafts fit: error: --model.init_args.{old} is now --model.init_args.remote.{new} (the target "
        "workers' options are one `remote` block); write it there"
    ), line
    config = tmp_path / "old.yaml"
    config.write_text(f"model:\n  init_args:\n    {old}: 2\n")
    (line, _) = fails(capsys, monkeypatch, *fit(tmp_path, f"--config={config}"))
    assert line == (
        f"lightning-drafts fit: error: {config}: model.init_args.{old} is now model.init_args.remote.{new} (the "
        "target workers' options are one `remote` block); write it there"
    ), line


@pytest.mark.parametrize(("code", "reason"), [(30, "Read-only file system"), (13, "Permission denied")])
def test_a_run_directory_that_cannot_be_written_is_named_with_the_settings_that_move_it(
    code, reason, tmp_path
):
    from lightning_drafts.cli.user_errors import describe

    # What os.makedirs raises for a logger's save_dir on a read-only disk or in a directory of another user.
    error = OSError(code, reason, str(tmp_path / "runs"))
    assert describe(error) == (
        f"{tmp_path / 'runs'} cannot be written: {reason}; write to a path in a directory you can write (a fit "
        "writes its run under trainer.logger.init_args.save_dir, or trainer.default_root_dir without a logger)"
    )
    # A missing file keeps its own message, and so does a message of ours that already names the fix.
    assert describe(FileNotFoundError(2, "No such file or directory", "x.jsonl")).startswith("[Errno 2]")
    ours = OSError(code, f"{tmp_path} cannot be written: {reason}; write elsewhere")
    assert describe(ours) == str(ours)


def test_a_class_path_of_the_old_top_level_packages_is_refused_with_its_new_name(
    tmp_path, capsys, monkeypatch
):
    config = tmp_path / "old.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: callbacks.AcceptanceCallback\n")
    (line, _) = fails(capsys, monkeypatch, *fit(tmp_path, f"--config={config}"))
    assert line == (
        f"lightning-drafts fit: error: {config} names 'callbacks.AcceptanceCallback': the callbacks package is now "
        "lightning_drafts.callbacks; write 'lightning_drafts.callbacks.AcceptanceCallback'"
    ), line
    (line, _) = fails(capsys, monkeypatch, *fit(tmp_path, "--data=datamodules.PackedChatDataModule"))
    assert line == (
        "lightning-drafts fit: error: --data names 'datamodules.PackedChatDataModule': the datamodules package is "
        "now lightning_drafts.datamodules; write 'lightning_drafts.datamodules.PackedChatDataModule'"
    ), line
