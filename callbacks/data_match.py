"""DataMatchCallback: at the start of fit, how many training answers are the target's own greedy tokens.

Printed and logged (``data/target_match``) once; a warning with the figure when it is low, since a draft
trained on answers the target would not write accepts fewer tokens when served. ``lightning-drafts
regenerate`` rewrites the answers with the target (then the figure is about 1).
"""

from __future__ import annotations

import warnings

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightning_drafts.training.data_match import DataMatch, target_match


class DataMatchCallback(L.Callback):
    """Measure :func:`~lightning_drafts.training.data_match.target_match` on ``num_documents`` training
    documents when fit starts; warn below ``warn_below``. ``num_documents: 0`` turns it off."""

    def __init__(self, num_documents: int = 16, warn_below: float = 0.5, seed: int = 0) -> None:
        if num_documents < 0:
            raise ValueError(f"num_documents = {num_documents}; it must be >= 0 (0 turns the check off)")
        if not 0.0 <= warn_below <= 1.0:
            raise ValueError(f"warn_below = {warn_below}; it must be a share in [0, 1]")
        self.num_documents = num_documents
        self.warn_below = warn_below
        self.seed = seed
        self.result: DataMatch | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        documents = getattr(getattr(trainer, "datamodule", None), "train_documents", None)
        target = getattr(pl_module, "target", None)
        if self.num_documents == 0 or documents is None or target is None:
            return
        if getattr(target, "decoder_released", False):
            # Training from captured features, or with the target on its own workers: no decoder here.
            rank_zero_info(
                "data match: not measured (the target's decoder is not in this process: target_decoder=False "
                "or remote.workers)"
            )
            return
        self.result = result = target_match(target, documents, self.num_documents, self.seed)
        if result.share is None or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics({"data/target_match": result.share}, step=trainer.global_step)
        figure = result.describe()
        rank_zero_info(f"data match: {figure}")
        if result.share < self.warn_below:
            warnings.warn(
                f"only {figure}: the answers were not written by this target, so the draft learns tokens "
                "the target rejects when served; rewrite them with `lightning-drafts regenerate --config "
                "<this config> --output answers.jsonl` and train on that file",
                stacklevel=2,
            )
