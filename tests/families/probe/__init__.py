"""A draft family that lives outside the library: everything a new family adds is this folder, one
``REGISTRY.register(PROBE)`` (a line in ``lightning_drafts/registry.py`` for a shipped family) and one
config (``quickstart.yaml``)."""

from tests.families.probe.family import PROBE
from tests.families.probe.module import ProbeDraft

__all__ = ["PROBE", "ProbeDraft"]
