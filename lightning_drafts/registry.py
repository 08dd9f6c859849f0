"""The draft families, one line each. A new family adds its folder, its ``FAMILY`` record and a line here."""

from __future__ import annotations

from lightning_drafts.dflash.family import FAMILY as DFLASH
from lightning_drafts.dspark.family import FAMILY as DSPARK
from lightning_drafts.eagle3.family import FAMILY as EAGLE3
from lightning_drafts.serving.family import FamilyRegistry

REGISTRY = FamilyRegistry(
    [
        EAGLE3,
        DFLASH,
        DSPARK,
    ]
)
