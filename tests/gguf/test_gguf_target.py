"""A GGUF file as the target and tokenizer: loaded through transformers' GGUF reader it is the same model
as its Hugging Face folder (bit for bit in float32, and in the dtype asked for), its tokenizer and chat
template are the folder's, its identity covers the file's bytes, and `convert-gguf` writes a folder that
reloads to the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_drafts import Eagle3Module
from lightning_drafts.cli.main import main
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.training.target import FrozenTarget
from tests.support.builders import packed_row, random_docs, stack_rows
from tests.support.tiny_gguf import tiny_tied_llama, write_gguf

VOCAB = 2048
LAYERS = (1, 14, 26)


def batch() -> dict:
    rows = [
        packed_row(random_docs([9, 6], vocab=VOCAB, seed=1), 20),
        packed_row(random_docs([13], vocab=VOCAB, seed=2), 20),
    ]
    return stack_rows(rows)


def features(target: FrozenTarget) -> dict[str, torch.Tensor]:
    return target.features(validate_batch(batch(), vocab_size=VOCAB), FeatureRequest(LAYERS, "all"))


def test_a_gguf_target_gives_the_features_of_its_hf_folder_exactly(tiny_gguf):
    path, folder = tiny_gguf
    from_gguf, from_folder = (
        FrozenTarget(str(path), attn_backend="sdpa"),
        FrozenTarget(str(folder), attn_backend="sdpa"),
    )
    # Every tensor, the tied head included (one tensor, as in the file, which has no output.weight).
    state, expected = from_gguf.model.state_dict(), from_folder.model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor), name
    assert from_gguf.model.config.tie_word_embeddings
    assert from_gguf.lm_head.weight.data_ptr() == from_gguf.input_embeddings.weight.data_ptr()
    got, want = features(from_gguf), features(from_folder)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_gguf_target_loads_in_the_configured_dtype(tiny_gguf):
    path, folder = tiny_gguf
    target = FrozenTarget(str(path), dtype="bfloat16")
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    state = target.model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        # Rounding the float32 weights to bfloat16 once: the GGUF load must not round through another dtype.
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], tensor.bfloat16()), name
    assert target.identity()["dtype"] == "bfloat16"


def test_the_tokenizer_and_chat_template_of_a_gguf_file_are_its_folders(tiny_gguf):
    path, folder = tiny_gguf
    tokenizer = PackedChatDataModule(tokenizer=str(path), setup_summary=False).tokenizer
    reference = AutoTokenizer.from_pretrained(folder)
    text = "Hello there, how are you?  I'm fine!\n<|im_start|>user\nok<|im_end|> 1234 ünï"
    assert tokenizer(text).input_ids == reference(text).input_ids
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello you"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(
        chat, tokenize=False
    )
    assert (tokenizer.eos_token, tokenizer.pad_token, len(tokenizer)) == (
        "<|im_end|>",
        "<|endoftext|>",
        VOCAB,
    )


def test_a_changed_gguf_file_is_refused_as_another_target(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    module = Eagle3Module(str(path), target_layer_ids=list(LAYERS), target_attn_backend="sdpa")
    manifest = {
        "target": {**module.target.identity(), "spec": str(path)},
        "layer_ids": list(LAYERS),
        "final_positions": "all",
    }
    module.check_features(manifest)
    # One decoder weight changed: the embedding, the head and the config (all a folder target is known by)
    # stay as they were; the file's bytes do not.
    model = tiny_tied_llama()
    with torch.no_grad():
        model.model.layers[7].mlp.down_proj.weight[0, 0] += 1.0
    changed = tmp_path / "changed.gguf"
    write_gguf(model, changed)
    other = Eagle3Module(str(changed), target_layer_ids=list(LAYERS), target_attn_backend="sdpa")
    identity = other.target.identity()
    assert {k: v for k, v in identity.items() if k != "file_sha256"} == {
        k: v for k, v in manifest["target"].items() if k not in ("file_sha256", "spec")
    }
    with pytest.raises(ValueError, match="captured from another target: target.file_sha256"):
        other.check_features(manifest)


def test_convert_gguf_writes_a_folder_that_reloads_to_the_same_logits(tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    out = tmp_path / "tiny-hf"
    main(["convert-gguf", str(path), str(out)])
    assert f"-> {out}" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    with safe_open(out / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    # The tied head is saved once, as the embedding.
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    # Plain weights: no quantization marker that would send an engine looking for the GGUF file.
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert converted.config.tie_word_embeddings and converted.dtype == torch.float32
    original = FrozenTarget(str(path)).model
    ids = torch.tensor([random_docs([12], vocab=VOCAB, seed=5)[0].tolist()])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)
    chat = [{"role": "user", "content": "hi"}]
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(chat, tokenize=False) == (
        AutoTokenizer.from_pretrained(tiny_gguf[1]).apply_chat_template(chat, tokenize=False)
    )
    # A folder that holds files already is refused with one line, and left as it was.
    with pytest.raises(SystemExit) as refused:
        main(["convert-gguf", str(path), str(out)])
    assert refused.value.code == 2


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such GGUF file: .*absent\.gguf"):
        FrozenTarget(str(tmp_path / "absent.gguf"))
