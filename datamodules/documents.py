"""Token documents in flat storage, the form packing and collation index into with numpy.

Document ``i`` is ``input_ids[starts[i] : starts[i] + lengths[i]]``. Selecting a split or truncating
long documents only rewrites ``starts`` / ``lengths``; the token arrays are shared, never copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LONG_DOCUMENT_POLICIES = ("truncate", "drop")


@dataclass(frozen=True)
class Documents:
    """Chat documents: flat ``input_ids`` / ``loss_mask`` plus each document's start and length."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def select(self, index: np.ndarray) -> Documents:
        """The documents at ``index`` (in that order), sharing the token arrays."""
        index = np.asarray(index, dtype=np.int64)
        return Documents(self.input_ids, self.loss_mask, self.starts[index], self.lengths[index])

    def supervised_per_document(self) -> np.ndarray:
        """Number of supervised tokens inside each document's current span."""
        if len(self) == 0:
            return np.zeros(0, dtype=np.int64)
        prefix = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        return prefix[self.starts + self.lengths] - prefix[self.starts]

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and loss mask of document ``i``."""
        span = slice(int(self.starts[i]), int(self.starts[i] + self.lengths[i]))
        return self.input_ids[span], self.loss_mask[span]

    def fit_to_width(self, max_tokens: int, long_documents: str) -> tuple[Documents, int, int]:
        """Apply the long-document policy: ``(documents, truncated count, dropped count)``.

        ``"truncate"`` keeps the first ``max_tokens`` tokens of a longer document; ``"drop"`` removes it.
        """
        if long_documents not in LONG_DOCUMENT_POLICIES:
            raise ValueError(
                f"long_documents={long_documents!r} is not one of {LONG_DOCUMENT_POLICIES}; choose 'truncate' "
                "to keep the first max_tokens tokens of longer documents or 'drop' to skip them"
            )
        too_long = self.lengths > max_tokens
        count = int(too_long.sum())
        if long_documents == "drop":
            return self.select(np.flatnonzero(~too_long)), 0, count
        clipped = np.minimum(self.lengths, max_tokens)
        return Documents(self.input_ids, self.loss_mask, self.starts, clipped), count, 0
