"""The fit config as `evaluate` and `regenerate` read it: the YAML file plus fit's dotted overrides."""

from __future__ import annotations

import pytest

from lightning_drafts.cli.fit_config import read_config_with_overrides

CONFIG = """\
model:
  init_args:
    target: shipped:tiny-llama
data:
  init_args:
    max_tokens: 512
    val_fraction: 0.02
"""


def test_overrides_set_nested_keys_with_yaml_values(tmp_path):
    path = tmp_path / "fit.yaml"
    path.write_text(CONFIG)
    config = read_config_with_overrides(
        path,
        [
            "--data.init_args.max_documents=100",
            "--data.init_args.data_files",
            "[a.jsonl, b.jsonl]",
            "--data.init_args.val_fraction=0",
            "--data.init_args.val_data_files=held.jsonl",
            "--model.init_args.target_seed=null",
        ],
    )
    assert config["data"]["init_args"] == {
        "max_tokens": 512,
        "val_fraction": 0,
        "max_documents": 100,
        "data_files": ["a.jsonl", "b.jsonl"],
        "val_data_files": "held.jsonl",
    }
    assert config["model"]["init_args"] == {"target": "shipped:tiny-llama", "target_seed": None}
    assert read_config_with_overrides(path, []) == read_config_with_overrides(path, ())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--max_documents=3"], "unknown argument '--max_documents=3'; a config override is written"),
        (["data.init_args.x=3"], "unknown argument 'data.init_args.x=3'"),
        (["--data.init_args.max_documents"], "--data.init_args.max_documents needs a value"),
        (["--data.init_args.x", "--data.init_args.y=1"], "--data.init_args.x needs a value"),
        (
            ["--data.init_args.max_tokens.width=3"],
            "--data.init_args.max_tokens.width: max_tokens is 512 in .*fit.yaml, not a section to set width in",
        ),
    ],
)
def test_a_bad_override_is_refused_with_the_form_to_write(tmp_path, overrides, message):
    path = tmp_path / "fit.yaml"
    path.write_text(CONFIG)
    with pytest.raises(ValueError, match=message):
        read_config_with_overrides(path, overrides)
