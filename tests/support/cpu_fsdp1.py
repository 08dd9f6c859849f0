"""Lightning's FSDPStrategy (FSDP1) on CPU processes, for the 2-process FSDP1 tests and benchmarks."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullStateDictConfig, OptimStateKeyType, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.api import FullOptimStateDictConfig


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with the two arguments torch's FSDP1 needs on a CPU, the rest as is:
    the CPU as the FSDP device (Lightning passes ``device_id=None`` there, which FSDP1 refuses: "FSDP
    needs a non-CPU accelerator device"), and full state dicts without ``offload_to_cpu`` (on tensors
    already on the CPU, FSDP1 frees the storage the copy shares and the save segfaults)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if any(isinstance(module, FSDP) for module in model.modules()):
            return super()._setup_model(model)  # wrapped by an earlier run: Lightning wraps nothing more
        return FSDP(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )

    def _full_state_dicts(self):
        return FSDP.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict:
        with self._full_state_dicts():
            return self.model.state_dict()

    def optimizer_state(self, optimizer) -> dict:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        with self._full_state_dicts():
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state
