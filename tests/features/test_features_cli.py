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
    assert sum(p.numel() for p in cli.model.target.decoder_layers.parameters()) == 0
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
