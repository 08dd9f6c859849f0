"""The tiny random target configs (``benchmarks/tiny_targets.py``), packed / padded batch builders, an export editor and a
check that repeated steps leave no tensor behind, shared by tests."""

from __future__ import annotations

import gc
import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The tiny target configs live beside the benchmarks, which build on them too (tests may import benchmarks,
# not the reverse); the tests take them from here.
from benchmarks.tiny_targets import TINY_TARGETS, VOCAB  # noqa: F401


def packed_row(docs: list[torch.Tensor], width: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """One contract row holding ``docs`` back to back, trailing padding folded into the last document."""
    lengths = [len(d) for d in docs]
    pad = width - sum(lengths)
    assert pad >= 0
    ids = torch.cat([*docs, torch.full((pad,), pad_id, dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in lengths[:-1]] + [torch.arange(lengths[-1] + pad)])
    return {
        "input_ids": ids[None],
        "attention_mask": (torch.arange(width) < sum(lengths)).long()[None],
        "loss_mask": (torch.arange(width) < sum(lengths)).long()[None],
        "position_ids": positions[None],
        "seq_lens": torch.tensor([lengths[:-1] + [lengths[-1] + pad]]),
    }


def padded_rows(docs: list[torch.Tensor], width: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The same documents one per row, right-padded, with no packing metadata (derived by the contract)."""
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)] = doc
        mask[row, : len(doc)] = 1
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone()}


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack single-row batches, zero-padding ``seq_lens`` to the widest row."""
    width = max(r["seq_lens"].shape[1] for r in rows)
    out = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "seq_lens"}
    out["seq_lens"] = torch.cat(
        [torch.nn.functional.pad(r["seq_lens"], (0, width - r["seq_lens"].shape[1])) for r in rows]
    )
    return out


def layers_run(target) -> tuple[list[int], list]:
    """The indices of the decoder layers each forward runs, in order, and the hooks recording them."""
    ran: list[int] = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, index=index: ran.append(index))
        for index, layer in enumerate(target.decoder_layers)
    ]
    return ran, hooks


def random_docs(lengths: list[int], vocab: int = VOCAB, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def rewrite_export(
    source: Path,
    destination: Path,
    config_edit: Callable[[dict], None] | None = None,
    tensor_edit: Callable[[dict], None] | None = None,
) -> Path:
    """A copy of an export with its config and / or tensors edited (to break it on purpose)."""
    shutil.copytree(source, destination)
    if config_edit is not None:
        config = json.loads((destination / "config.json").read_text())
        config_edit(config)
        (destination / "config.json").write_text(json.dumps(config))
    if tensor_edit is not None:
        tensors = load_file(str(destination / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(destination / "model.safetensors"))
    return destination


class PromptRows(torch.utils.data.Dataset):
    """Packed rows of two documents, each a 4-token prompt followed by a supervised answer (token ids
    below ``vocab``)."""

    def __init__(self, rows: int, vocab: int = VOCAB) -> None:
        self.rows = []
        for i in range(rows):
            row = packed_row(random_docs([9, 8], vocab=vocab, seed=200 + i), 20)
            row["loss_mask"][0, :4] = 0
            row["loss_mask"][0, 9:13] = 0
            self.rows.append({key: value[0] for key, value in row.items()})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def assert_target_greedy(target, prompts, generations, max_new_tokens: int, with_hf: bool = True) -> None:
    """Each generation is the target's own greedy continuation of its prompt: by our reference decode, and
    (``with_hf``) by transformers' own greedy ``generate`` (KV cache, no EOS stop), an independent one."""
    from lightning_drafts.serving.decode import greedy_generate

    for prompt, generated in zip(prompts, generations, strict=True):
        assert generated == greedy_generate(target, prompt, max_new_tokens), (
            "speculative decoding changed the output"
        )
        if with_hf:
            hf = target.model.generate(
                prompt[None],
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
            )
            assert hf[0, prompt.numel() :].tolist() == generated


def assert_no_tensor_outlives(step: Callable[[], object], warmup: int = 2, repeats: int = 3) -> None:
    """``step`` (its result dropped) run ``repeats`` more times leaves exactly as many live tensors as it
    left once: one left behind per step grows host memory without bound over a training run, whether a
    container or an autograd graph kept alive through a reference cycle holds it. The warmup lets what is
    made once (optimizer or gradient buffers, caches keyed by shape) exist before anything is counted."""
    for _ in range(warmup):
        step()
    gc.collect()
    # Everything older (the whole test session) leaves the generations that get_objects and collections
    # walk: only what the steps make is counted, in milliseconds, and references from older objects
    # still keep it alive.
    gc.freeze()
    try:
        step()
        before = _new_tensors()
        for _ in range(repeats):
            step()
        after = _new_tensors()
    finally:
        gc.unfreeze()
    grown, shrunk = after - before, before - after
    assert not grown and not shrunk, (
        f"{sum(grown.values())} tensors outlived {repeats} steps (shape, dtype: count): {dict(grown)}"
        + (f"; {dict(shrunk)} were freed" if shrunk else "")
    )


def _new_tensors() -> Counter[tuple[tuple[int, ...], torch.dtype]]:
    """Live tensors by (shape, dtype) among the objects made since ``gc.freeze``, after a collection."""
    gc.collect()
    # type(), not isinstance(): isinstance reads ``__class__``, which some lazy module proxies warn on.
    return Counter(
        (tuple(obj.shape), obj.dtype) for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)
    )
