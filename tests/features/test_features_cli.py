"""The command line: ``capture`` a quickstart config's features, then ``fit`` the same config from them
(``--data.init_args.features_dir``) without the target's decoder running or even held in memory; the data module refuses a
features directory made from other data, naming what differs."""

from __future__ import annotations

import json

import pytest

from lightning_drafts.cli.main import main, run_cli
from lightning_drafts.datamodules import PackedChatDataModule
from tests.cli.test_cli import short_fit
from tests.families.family_case import ROOT

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures"),
]

QUICKSTARTS = sorted((ROOT / "configs" / "quickstart").glob("*.yaml"))
DOCUMENTS = 60


def capture_quickstart(config, directory, cache) -> None:
    main(
        [
            "capture",
            f"--config={config}",
            f"--output={directory}",
            f"--data.init_args.max_documents={DOCUMENTS}",
            f"--data.init_args.cache_dir={cache}",
        ]
    )


@pytest.mark.parametrize("config", QUICKSTARTS, ids=[path.stem for path in QUICKSTARTS])
def test_capture_then_fit_from_the_features(config, tmp_path):
    features = tmp_path / "features"
    capture_quickstart(config, features, tmp_path / "cache")
    manifest = json.loads((features / "features.json").read_text())
    assert manifest["complete"] and manifest["dtype"] == "bfloat16"
    assert manifest["sources"]["data_files"]["documents"] == DOCUMENTS
    cli = run_cli(
        [
            *short_fit(config, tmp_path),
            f"--data.init_args.max_documents={DOCUMENTS}",
            f"--data.init_args.features_dir={features}",
            # Not even the decoder's weights are needed: only the embedding, final norm and LM head stay.
            "--model.init_args.target_decoder=false",
            "--trainer.callbacks+=tests.features.feature_cases.RefuseTargetForward",
        ]
    )
    assert cli.trainer.global_step == 4
    assert len(cli.model.target.decoder_layers) == 0  # never built: the checkpoint's layers are not read
    assert cli.datamodule.features_manifest["directory"] == str(features)


def test_the_data_module_refuses_features_of_other_data_naming_what_differs(tmp_path):
    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    features, cache = tmp_path / "features", tmp_path / "cache"
    capture_quickstart(config, features, cache)

    def data(**options) -> PackedChatDataModule:
        settings = {
            "tokenizer": "shipped:tiny-llama",
            "max_tokens": 512,
            "val_fraction": 0.02,
            "max_documents": DOCUMENTS,
            "cache_dir": str(cache),
            "features_dir": str(features),
            "setup_summary": False,
        }
        module = PackedChatDataModule(**{**settings, **options})
        module.setup("fit")
        return module

    # Another validation split of the same documents is the same capture.
    resplit = data(seed=5, val_fraction=0.1)
    assert resplit.features_manifest is not None
    assert "target_hidden_states" in next(iter(resplit.train_dataloader()))
    assert "target_hidden_states" in next(iter(resplit.val_dataloader()))
    # Counting the draft vocabulary's tokens reads no features.
    assert not any(key.startswith("target_") for key in next(iter(resplit.token_dataloader())))
    with pytest.raises(ValueError, match="captured from other documents for data_files"):
        data(max_documents=DOCUMENTS - 10)
    with pytest.raises(ValueError, match="captured from other documents for data_files"):
        data(max_tokens=64)
    with pytest.raises(ValueError, match="captured with another tokenizer"):
        data(tokenizer=None)  # the embedded Mistral tokenizer
    with pytest.raises(ValueError, match="captured with another chat_template"):
        data(chat_template="mistral")


def write_chats(path, conversations) -> str:
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return str(path)


@pytest.mark.parametrize("validation", ["val_data_files", "val_fraction"])
def test_validation_from_features_gives_the_online_val_metrics(validation, tmp_path):
    """The capture covers the validation documents (a separate file, or the held-out split of the training
    file); a fit from the features validates on them without the target and logs the online val/ metrics."""
    chats = PackedChatDataModule(tokenizer="shipped:tiny-llama", max_documents=48, setup_summary=False)
    conversations = [messages for _, messages in chats.conversations()]
    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    if validation == "val_data_files":
        split = [
            f"--data.init_args.data_files={write_chats(tmp_path / 'train.jsonl', conversations[:40])}",
            f"--data.init_args.val_data_files={write_chats(tmp_path / 'val.jsonl', conversations[40:])}",
            "--data.init_args.val_fraction=0",
        ]
    else:
        split = [
            f"--data.init_args.data_files={write_chats(tmp_path / 'train.jsonl', conversations)}",
            "--data.init_args.val_fraction=0.2",
        ]
    data = [*split, f"--data.init_args.cache_dir={tmp_path / 'cache'}"]
    features = tmp_path / "features"
    # float32 features: the features' val/ metrics are the online ones exactly.
    main(["capture", f"--config={config}", f"--output={features}", "--dtype=float32", *data])
    sources = json.loads((features / "features.json").read_text())["sources"]
    assert sources["data_files"]["documents"] == (40 if validation == "val_data_files" else 48)
    assert ("val_data_files" in sources) == (validation == "val_data_files")

    def val_metrics(save_dir, *extra) -> dict[str, float]:
        cli = run_cli(
            [
                "fit",
                f"--config={config}",
                *data,
                "--trainer.max_steps=2",
                "--trainer.val_check_interval=2",
                "--trainer.limit_val_batches=2",
                f"--trainer.logger.init_args.save_dir={tmp_path / save_dir}",
                *extra,
            ]
        )
        assert cli.trainer.global_step == 2
        return {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}

    online = val_metrics("online")
    offline = val_metrics(
        "features",
        f"--data.init_args.features_dir={features}",
        "--model.init_args.target_decoder=false",
        "--trainer.callbacks+=tests.features.feature_cases.RefuseTargetForward",
    )
    assert {"val/loss", "val/accept_len", "val/accuracy"} <= online.keys()
    assert offline == online


def test_validation_files_missing_from_the_capture_are_refused(tmp_path):
    chats = PackedChatDataModule(tokenizer="shipped:tiny-llama", max_documents=12, setup_summary=False)
    conversations = [messages for _, messages in chats.conversations()]
    train = write_chats(tmp_path / "train.jsonl", conversations[:8])
    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    data = [f"--data.init_args.data_files={train}", "--data.init_args.val_fraction=0"]
    cache = f"--data.init_args.cache_dir={tmp_path / 'cache'}"
    main(["capture", f"--config={config}", f"--output={tmp_path / 'features'}", *data, cache])
    module = PackedChatDataModule(
        tokenizer="shipped:tiny-llama",
        max_tokens=512,
        data_files=train,
        val_data_files=write_chats(tmp_path / "val.jsonl", conversations[8:]),
        cache_dir=str(tmp_path / "cache"),
        features_dir=str(tmp_path / "features"),
        setup_summary=False,
    )
    with pytest.raises(ValueError, match="holds no features for val_data_files .* capture` again"):
        module.setup("fit")
