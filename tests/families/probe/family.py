"""The probe's record for the family registry (a shipped family's would be listed in registry.py)."""

from __future__ import annotations

from lightning_drafts.serving.family import DraftFamily
from tests.families.probe.export import (
    ARCHITECTURE,
    default_num_steps,
    load_probe_module,
    load_probe_speculator,
    validate_probe_export,
)
from tests.families.probe.module import ProbeDraft

PROBE = DraftFamily(
    name="probe",
    modules=(ProbeDraft,),
    architectures=(ARCHITECTURE,),
    validate=validate_probe_export,
    load_speculator=load_probe_speculator,
    load_training_module=load_probe_module,
    default_num_steps=default_num_steps,
)
