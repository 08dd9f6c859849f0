"""The DFlash and DFlash2 draft networks: DFlash is the plain block drafter; DFlash2 adds the in-block
convolutions (identity at init) and the pairwise path selector over each slot's candidates."""

from __future__ import annotations

from transformers import Qwen3Config

from lightning_drafts.blockdraft.draft import BlockDraft
from lightning_drafts.dflash.path_selector import CandidateSelector

DFlashDraft = BlockDraft


class DFlash2Draft(BlockDraft):
    """DFlash plus the in-block convolutions (identity at init) and the pairwise path selector."""

    def __init__(
        self,
        config: Qwen3Config,
        num_target_features: int,
        conv_kernel_size: int = 2,
        conv_group_size: int = 16,
        selector_rank: int = 256,
    ) -> None:
        super().__init__(config, num_target_features, conv=(conv_kernel_size, conv_group_size))
        self.candidate_selector = CandidateSelector(
            config.vocab_size, config.hidden_size, selector_rank, config.initializer_range
        )
