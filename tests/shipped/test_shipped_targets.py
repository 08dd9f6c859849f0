"""The tiny trained targets the package ships: they load from disk as plain Hugging Face models, fit the
shapes vLLM's CPU kernels run, write varied text (a random target does not), and the remake script
rebuilds the same tokenizer."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightning_drafts.datamodules import PackedChatDataModule, embedded_corpus_rows
from lightning_drafts.serving.prompts import prompts_from_datamodule
from lightning_drafts.shipped import (
    MASK_TOKEN_ID,
    SHIPPED_TARGETS,
    SPECIAL_TOKENS,
    resolve_shipped,
    shipped_target_path,
)
from lightning_drafts.training.target import build_causal_lm
from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
# vLLM 0.32's CPU attention runs these head sizes; its CPU MLA kernel only a 512 + 64 latent.
VLLM_CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    data = PackedChatDataModule(tokenizer="shipped:tiny-llama", max_tokens=512, val_fraction=0.02)
    return prompts_from_datamodule(data, limit=8)


def greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    ids = prompt[None]
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids[0, prompt.numel() :].tolist()


@pytest.mark.parametrize("name", SHIPPED_TARGETS)
def test_shipped_target_loads_and_fits_vllm_cpu_shapes(name: str) -> None:
    path = shipped_target_path(name)
    for file in path.iterdir():
        assert file.stat().st_mode & 0o777 == 0o644, f"{file} is not world-readable"
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.vocab_size == len(tokenizer) == 2048
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tokenizer.eos_token_id == config.eos_token_id == 2 and tokenizer.pad_token_id == 0
    if config.model_type == "deepseek_v3":
        assert config.kv_lora_rank + config.qk_rope_head_dim == 576
    else:
        assert config.head_dim in VLLM_CPU_HEAD_SIZES
    model = build_causal_lm(f"shipped:{name}")
    assert type(model).__name__ == config.architectures[0]
    assert next(model.parameters()).dtype == torch.float32


def test_the_mask_token_never_occurs_in_text() -> None:
    tokenizer = AutoTokenizer.from_pretrained(shipped_target_path("tiny-qwen3"))
    texts = [m["content"] for row in embedded_corpus_rows() for m in row["messages"]]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert not any(MASK_TOKEN_ID in ids for ids in encoded)
    assert sum(map(len, encoded)) > 3_000_000


@pytest.mark.parametrize("name", SHIPPED_TARGETS)
def test_shipped_targets_learned_the_corpus_and_write_varied_text(name: str, prompts) -> None:
    trained = build_causal_lm(f"shipped:{name}").eval()
    torch.manual_seed(0)
    random = AutoModelForCausalLM.from_config(trained.config).eval()
    data = PackedChatDataModule(tokenizer=f"shipped:{name}", max_tokens=256, val_fraction=0.02)
    data.setup("validate")
    documents = [torch.as_tensor(data.val_documents.tokens(i)[0], dtype=torch.long) for i in range(8)]
    with torch.no_grad():
        losses = [trained(input_ids=d[None], labels=d[None], use_cache=False).loss.item() for d in documents]
    # Uniform over 2,048 ids is 7.62 nats; the shipped targets reach about half of it on held-out text.
    assert sum(losses) / len(losses) < 0.65 * math.log(2048)
    distinct = [len(set(greedy(trained, p, 64))) for p in prompts]
    distinct_random = [len(set(greedy(random, p, 64))) for p in prompts]
    assert min(distinct) >= 8, distinct
    # A random target of the same shape (seed 0) repeats a few tokens: 42 / 68 / 12 distinct in all over
    # these 8 x 64 for Llama / Qwen3 / DeepSeek-V3, against 162 / 169 / 142 for the shipped ones.
    assert sum(distinct) > 2 * sum(distinct_random), (distinct, distinct_random)


def test_resolve_shipped_names_the_known_targets() -> None:
    assert resolve_shipped("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert resolve_shipped("shipped:tiny-llama") == str(shipped_target_path("tiny-llama"))
    with pytest.raises(ValueError, match=r"no shipped target named 'tiny-gpt'.*tiny-llama"):
        resolve_shipped("shipped:tiny-gpt")


def test_the_remake_script_rebuilds_the_shipped_tokenizer(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_shipped_targets.py"), "--only", "tiny-llama"]
        + ["--steps", "2", "--prompts", "1", "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    remade, shipped = tmp_path / "tiny-llama", shipped_target_path("tiny-llama")
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (remade / file).read_text() == (shipped / file).read_text(), file
    # config.json stamps the transformers release that wrote it; the architecture must match, not the stamp.
    remade_config, shipped_config = (json.loads((d / "config.json").read_text()) for d in (remade, shipped))
    assert remade_config.pop("transformers_version") and shipped_config.pop("transformers_version")
    assert remade_config == shipped_config
    record = json.loads((remade / "training.json").read_text())
    assert record["training"]["steps"] == 2 and len(record["loss"]) == 2
