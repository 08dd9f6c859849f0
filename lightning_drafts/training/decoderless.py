"""Load a checkpoint's causal LM without its decoder layers: the embedding, final norm and LM head only.

A draft training from captured features reads nothing else of its target, so the decoder's weights are
never read from disk, let alone held in memory: the model is built with zero decoder layers and
``from_pretrained`` reads only the tensors that model has (the checkpoint's layer tensors are left unread,
as unexpected keys). The config is then given its layer count back, so the target describes itself (its
config hash, layer count and layer-id checks) exactly as the full model does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AutoConfig, PreTrainedModel

from lightning_drafts.training.auto_model import target_model_class

# transformers logs its loading report (every key it left unread) at warning level on this logger.
REPORT_LOGGER = "transformers.modeling_utils"


def load_without_decoder(path: str | os.PathLike, dtype: torch.dtype | str) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` with no decoder layers built or read.

    Raises ``ValueError`` when the checkpoint lacks a tensor the layer-less model has (its embedding, final
    norm or LM head): those would be random, and the features' teacher with them."""
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    layers = int(text.num_hidden_layers)
    text.num_hidden_layers = 0
    with _without_load_report():
        model, info = target_model_class(config).from_pretrained(
            path, config=config, dtype=dtype, output_loading_info=True
        )
    if info["missing_keys"]:
        raise ValueError(
            f"the checkpoint {str(path)!r} has no {sorted(info['missing_keys'])}, which the target's embedding, "
            "final norm and LM head need; load it with target_decoder=true to see transformers' report"
        )
    model.config.get_text_config().num_hidden_layers = layers
    return model


@contextmanager
def _without_load_report() -> Iterator[None]:
    """Drop transformers' loading report: here every decoder tensor is unread on purpose, and the report would
    list them all as a problem ("not ok if you expect identical arch")."""
    logger = logging.getLogger(REPORT_LOGGER)
    drop = _DropLoadReport()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()
