"""Whole answers from the target for a batch of prompts, by one interface over two engines.

:class:`TransformersEngine` runs ``generate`` on the model in this process (greedy or seeded sampling,
prompts of one length batched together); :class:`VLLMEngine` sends the batch to a vLLM session in its own
interpreter (:mod:`lightning_drafts.serving.vllm_engine`). Both return each answer's tokens up to, not
including, its first stop token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class AnswerSampling:
    """How each assistant turn is generated: greedy at ``temperature`` 0, else nucleus sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature}; it must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}; it must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens}; it must be >= 1")


@dataclass(frozen=True)
class Request:
    """One assistant turn to generate: the rendered prompt's token ids and the seed of its sampling."""

    prompt: list[int]
    seed: int


# An engine turns requests into the generated token ids (stop token excluded), one list per request.
Engine = Callable[[Sequence[Request], AnswerSampling], list[list[int]]]


class TransformersEngine:
    """Generation on the frozen target with transformers' ``generate`` (KV cache, left padding).

    Greedy requests run as one left-padded batch; sampled ones one at a time under their own seed, so a
    token drawn for one conversation never depends on the others in its batch.
    """

    def __init__(self, model: Any, pad_token_id: int, stop_token_ids: Iterable[int]) -> None:
        self.model = model.eval()
        self.pad_token_id = int(pad_token_id)
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        if not self.stop_token_ids:
            raise ValueError("the tokenizer has no eos token: pass the ids that end an assistant turn")

    @torch.no_grad()
    def __call__(self, requests: Sequence[Request], sampling: AnswerSampling) -> list[list[int]]:
        if sampling.temperature == 0:
            return self._generate([r.prompt for r in requests], sampling)
        outputs = []
        for request in requests:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(request.seed)
                outputs += self._generate([request.prompt], sampling)
        return outputs

    def _generate(self, prompts: list[list[int]], sampling: AnswerSampling) -> list[list[int]]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        options: dict[str, Any] = {"do_sample": False}
        if sampling.temperature > 0:
            options = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p}
        generated = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            top_k=None,
            **options,
        )[:, width:].tolist()
        return [_until_stop(tokens, self.stop_token_ids) for tokens in generated]


class VLLMEngine:
    """Generation by a real vLLM engine in its own environment
    (:class:`~lightning_drafts.serving.vllm_engine.VLLMSession`), started at the first call and kept for
    every later one; use it as a context manager (or :meth:`close` it) so the engine stops.

    Greedy turns are the transformers engine's token for token (tested). Sampled turns use vLLM's own
    generator under the same per-(seed, row, turn) seeds, so they are reproducible and independent of the
    batch, but not the tokens the transformers engine would sample.
    """

    def __init__(
        self,
        target: str | Path,
        stop_token_ids: Iterable[int],
        python: str | Path | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.target = str(target)
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        self.python = python
        self.max_model_len = max_model_len
        self._session: Any = None

    def __call__(self, requests: Sequence[Request], sampling: AnswerSampling) -> list[list[int]]:
        from lightning_drafts.serving.vllm_engine import VLLMSession

        if self._session is None:
            self._session = VLLMSession(self.target, self.python, max_model_len=self.max_model_len)
        generations = self._session.generate(
            [r.prompt for r in requests],
            sampling.max_new_tokens,
            self.stop_token_ids,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seeds=[r.seed for r in requests],
        )
        return [_until_stop(t, self.stop_token_ids) for t in generations]

    def close(self) -> None:
        """Stop the engine, if one was started."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _until_stop(tokens: list[int], stop: Sequence[int]) -> list[int]:
    for position, token in enumerate(tokens):
        if token in stop:
            return tokens[:position]
    return tokens
