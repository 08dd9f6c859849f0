"""Shared fixtures: offline hub, two threads, and one tiny target config per supported family."""

from __future__ import annotations

import os

import pytest
import torch

from tests.builders import TINY_TARGETS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)


@pytest.fixture(params=sorted(TINY_TARGETS))
def target_config(request) -> dict:
    return dict(TINY_TARGETS[request.param])
