"""A draft that refuses the hyperparameters its checkpoint records, named with the checkpoint.

``export`` and ``fit`` / ``validate --ckpt_path`` build the draft from the hyperparameters a checkpoint
records (LightningCLI merges them over the config). A value the draft refuses there, or an argument it no
longer takes, was reported as if the config held it, without the checkpoint: the user looked for it in
the wrong file. Here the draft's own error keeps its words and gains the checkpoint's path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning_drafts.training.module import DraftModule

# What Python says when a recorded hyperparameter is an argument the draft class no longer takes.
_UNKNOWN_ARGUMENT = re.compile(r"__init__\(\) got an unexpected keyword argument")


@contextmanager
def naming_checkpoint(ckpt_path: str | Path | None) -> Iterator[None]:
    """Run the block that builds a draft from ``ckpt_path``'s hyperparameters; an error the draft raised
    about them is raised again as one ``ValueError`` naming the checkpoint (others pass unchanged)."""
    try:
        yield
    except (ValueError, TypeError) as error:
        refused = None if ckpt_path is None else _draft_error(error)
        if refused is None:
            raise
        older = (
            "; it records an argument this version of the draft does not take, so it was written by another "
            "lightning-drafts version: load it with that version"
            if isinstance(refused, TypeError)
            else ""
        )
        raise ValueError(
            f"{ckpt_path}: the draft refuses the hyperparameters this checkpoint records: {refused}{older}"
        ) from error


def _draft_error(error: BaseException) -> BaseException | None:
    """The error of ``error``'s chain raised by a draft's ``__init__`` (or by the call to it), if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TypeError) and _UNKNOWN_ARGUMENT.search(str(current)):
            return current
        trace = current.__traceback__
        while trace is not None:
            frame = trace.tb_frame
            if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), DraftModule):
                return current
            trace = trace.tb_next
        current = current.__cause__ or current.__context__
    return None
