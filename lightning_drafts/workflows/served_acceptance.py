"""ServedAcceptanceCallback: real speculative decoding from the exported draft at validation time.

``val/accept_len`` is the training-time estimate (tau_sim); ``val/served_accept_len`` is what a serving
engine would see from the files ``export`` writes, so a gap between the two (wrong layer ids, an LM head
lost on export, a misread ``d2t``) shows up during training instead of after deployment.
"""

from __future__ import annotations

import tempfile
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_drafts.core.checks import check_int
from lightning_drafts.serving.prompts import prompts_from_batch
from lightning_drafts.serving.report import EvaluationReport
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.evaluate import evaluate_export


class ServedAcceptanceCallback(L.Callback):
    """Exports the module to a temporary directory and serves it on a few validation prompts.

    Prompts are the tokens before each validation document's first supervised (assistant) token, taken
    from the first validation batches. The served draft proposes ``num_steps`` tokens per round (default:
    the family's, e.g. EAGLE-3's ``ttt_length``) and the frozen target verifies them; the mean acceptance
    length is logged as ``val/served_accept_len`` (averaged over ranks).

    Args:
        num_prompts: prompts per evaluation (per rank).
        max_new_tokens: tokens generated per prompt.
        every_n_val_epochs: evaluate at every n-th validation run (sanity checks never count).
        num_steps: tokens proposed per round (``None``: the family default).
        max_prompt_tokens: keep at most this many prompt tokens (the last ones).
    """

    def __init__(
        self,
        num_prompts: int = 4,
        max_new_tokens: int = 32,
        every_n_val_epochs: int = 1,
        num_steps: int | None = None,
        max_prompt_tokens: int | None = 256,
    ) -> None:
        for name, value in (
            ("num_prompts", num_prompts),
            ("max_new_tokens", max_new_tokens),
            ("every_n_val_epochs", every_n_val_epochs),
        ):
            check_int(f"ServedAcceptanceCallback {name}", value, 1)
        self.num_prompts = num_prompts
        self.max_new_tokens = max_new_tokens
        self.every_n_val_epochs = every_n_val_epochs
        self.num_steps = num_steps
        self.max_prompt_tokens = max_prompt_tokens
        self.validation_runs = 0
        self._due = False
        self._prompts: list[Tensor] = []
        # The last evaluation's report (its prompts, the served generations, per-position counts).
        self.report: EvaluationReport | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        if isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy):
            # Exporting needs the whole draft on each rank; a sharded one would need a collective gather.
            raise ValueError(
                f"ServedAcceptanceCallback needs the whole draft on every rank, but the strategy is "
                f"{type(trainer.strategy).__name__} (sharded); drop the callback and run `lightning-drafts "
                "evaluate` on exported checkpoints, or train with DDP / one device"
            )

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prompts = []
        self._due = not trainer.sanity_checking and self.validation_runs % self.every_n_val_epochs == 0

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._due and len(self._prompts) < self.num_prompts and isinstance(batch, dict):
            needed = self.num_prompts - len(self._prompts)
            self._prompts += prompts_from_batch(batch, needed, self.max_prompt_tokens)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        due, self._due = self._due, False
        self.validation_runs += 1
        if not due:
            return
        if not self._prompts:
            rank_zero_warn(
                "ServedAcceptanceCallback found no prompt in the validation batches (a prompt is the tokens "
                "before a document's first loss_mask token); val/served_accept_len is not logged"
            )
            return
        value = self._served_accept_len(pl_module)
        if value is None:
            rank_zero_warn(
                "ServedAcceptanceCallback: no verify round ran (every generation stopped after its first token); "
                "val/served_accept_len is not logged"
            )
            return
        pl_module.log("val/served_accept_len", value, on_epoch=True, sync_dist=True, batch_size=1)

    def _served_accept_len(self, pl_module: L.LightningModule) -> float | None:
        target = pl_module.target
        if getattr(target, "decoder_released", False):
            target = self._whole_target(pl_module)
        with tempfile.TemporaryDirectory(prefix="served-draft-") as directory:
            pl_module.export(directory)
            report = evaluate_export(
                directory,
                self._prompts,
                target=target,
                max_new_tokens=self.max_new_tokens,
                num_steps=self.num_steps,
                with_training_estimate=False,
            )
        self.report = report
        return report.served.accept_len

    def _whole_target(self, pl_module: L.LightningModule) -> FrozenTarget:
        """The trainer holds no decoder (the target runs on its own workers, or the draft trains from
        features): the target is built here as the workers build it, for these few prompts, and must be
        the trainer's (its identity: config, dtype, sizes, embedding and LM head digest)."""
        spec = pl_module.target_record()["target"]
        if spec is None:
            raise ValueError(
                "ServedAcceptanceCallback needs the target to serve with, but the trainer holds none with its "
                "decoder and the module was given a model instance; pass the target as a path or config"
            )
        hparams = pl_module.hparams
        built = FrozenTarget(spec, dtype=hparams.get("target_dtype"), seed=hparams.get("target_seed", 0))
        mine, theirs = pl_module.target.identity(), built.identity()
        for field, value in mine.items():
            if theirs.get(field) != value:
                raise ValueError(
                    f"the target built to serve the draft differs from the trainer's: {field} is "
                    f"{theirs.get(field)!r} there but {value!r} in the trainer; build it with the run's target, "
                    "target_dtype and target_seed"
                )
        return built.to(pl_module.device)

    def state_dict(self) -> dict[str, Any]:
        return {"validation_runs": self.validation_runs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validation_runs = int(state_dict.get("validation_runs", 0))
