"""The 2-process CPU trainer (gloo) of the distributed benchmarks and tests: DDP, FSDP2 or FSDP1.

``trainer(strategy, steps, callbacks)`` is a Lightning ``Trainer`` on 2 CPU processes with one of three
strategies (``strategy_of``): ``"ddp"``; ``"fsdp2"`` (``ModelParallelStrategy``, data parallel over the two,
full state dicts); ``"fsdp1"`` (Lightning's ``FSDPStrategy`` made to run on a CPU, ``CPUFSDPStrategy``, the
target's decoder layers its FSDP units as the FSDP1 recipe wraps them, full state dicts). Every strategy
clips the gradients by norm to ``CLIP``.

Used by ``benchmarks/checkpoint_memory.py`` and by ``tests/scripts/distributed_grads.py`` and
``tests/scripts/objective_grads.py`` (run by ``tests/distributed/``).
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FullStateDictConfig, OptimStateKeyType, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.api import FullOptimStateDictConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

# Below every draft's gradient norm in the 2-process tests: clipping acts on every step there.
CLIP = 0.02


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


def strategy_of(name: str) -> object:
    if name == "ddp":
        return "ddp"
    if name == "fsdp1":
        # As the FSDP1 recipe: the target's decoder layers are the FSDP units.
        return CPUFSDPStrategy(
            process_group_backend="gloo",
            state_dict_type="full",
            auto_wrap_policy={LlamaDecoderLayer, Qwen3DecoderLayer, DeepseekV3DecoderLayer},
        )
    return ModelParallelStrategy(
        data_parallel_size=2,
        tensor_parallel_size=1,
        process_group_backend="gloo",
        save_distributed_checkpoint=False,
    )


def trainer(strategy: str, steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_of(strategy),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        gradient_clip_val=CLIP,
    )
