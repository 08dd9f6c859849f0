"""Build an export's draft the way vLLM builds it and load the export through vLLM's own loader, without
serving: a static check for drafts vLLM's CPU build cannot run (DSpark: "Model Runner V1 does not support:
dspark speculative decoding") and a cheap one for those it can.

Run with the python of a vLLM environment, as ``python vllm_static_layout.py REQUESTS.json RESULTS.json``;
each request names a ``target`` directory (its ``config.json`` is enough), a ``draft`` export and vLLM's
speculative ``method``. Per request, vLLM's config pipeline (``EngineArgs.create_engine_config``: the
architecture rewrites, the EAGLE / DSpark config handling) resolves the draft class, which is built on the
CPU with every parameter set to a sentinel, and the export's tensors go through the class's
``load_weights``: vLLM's own name mapping, stacking and shape checks. The result says which parameters it
left at the sentinel (wholly or in part), how many elements it filled against how many the export holds
(what it dropped), which config fields the draft class read during construction and loading and where
each came from, and the speculative settings vLLM derived (captured layers, tokens per round, mask token).

Going through vLLM's code rather than parsing its source keeps the check true to the installed vLLM: a
renamed field, a new stacked weight or a changed default shows up here as it would at serving time.
Serving itself goes through the project's runner (``lightning_drafts/serving/vllm_runner.py``); this checks
what serving cannot show on CPU. Imports nothing from this project.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Never a value a checkpoint holds: d2t offsets are bounded by the vocabulary size.
INT_SENTINEL = -(2**62)
MISSING = object()


@contextmanager
def recorded_reads(config: Any) -> Iterator[list[str]]:
    """The public attribute names read on ``config`` (this instance only) while the block runs, including
    reads that fail (a ``getattr`` with a default falls back to vLLM's own value there)."""
    cls = type(config)
    had_own = "__getattribute__" in cls.__dict__
    original = cls.__getattribute__
    reads: list[str] = []

    def getattribute(self: Any, name: str) -> Any:
        if self is config and not name.startswith("_"):
            reads.append(name)
        return original(self, name)

    cls.__getattribute__ = getattribute
    try:
        yield reads
    finally:
        if had_own:
            cls.__getattribute__ = original
        else:
            del cls.__getattribute__


def filled_elements(model: Any) -> tuple[dict[str, list[int]], int]:
    """Per parameter ``[filled, checked]`` element counts and the total filled, counting only the real rows
    of vocabulary-padded embeddings / LM heads."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    real_rows = {
        id(module.weight): module.org_vocab_size
        for module in model.modules()
        if isinstance(module, VocabParallelEmbedding)
    }
    counts, total = {}, 0
    for name, parameter in model.named_parameters():
        data = parameter.data[: real_rows.get(id(parameter), parameter.shape[0] if parameter.dim() else 1)]
        if data.is_floating_point():
            filled = int((~torch.isnan(data)).sum())
        else:
            filled = int((data != INT_SENTINEL).sum())
        counts[name] = [filled, data.numel()]
        total += filled
    return counts, total


def ensure_distributed(config: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    if parallel_state.model_parallel_is_initialized():
        return
    with set_current_vllm_config(config):
        init_worker_distributed_environment(config, 0, f"file://{tempfile.mktemp()}", 0, "gloo")


def check(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    draft = Path(request["draft"])
    speculative = {"method": request["method"], "model": str(draft)}
    if request.get("num_speculative_tokens") is not None:
        speculative["num_speculative_tokens"] = request["num_speculative_tokens"]
    config = EngineArgs(
        model=request["target"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=request["max_model_len"],
        speculative_config=speculative,
    ).create_engine_config()
    ensure_distributed(config)
    draft_config = config.speculative_config.draft_model_config
    hf_config = draft_config.hf_config
    exported = load_file(str(draft / "model.safetensors"))
    written = json.loads((draft / "config.json").read_text())
    result: dict[str, Any] = {"architecture": draft_config.architectures[0]}
    with recorded_reads(hf_config) as reads, set_current_vllm_config(config):
        model = initialize_model(config, model_config=draft_config)
        result["model_class"] = type(model).__name__
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan") if parameter.is_floating_point() else INT_SENTINEL)
        try:
            model.load_weights(iter(exported.items()))
        except Exception as error:  # noqa: BLE001 - the test reports vLLM's refusal verbatim
            result["load_error"] = f"{type(error).__name__}: {error}"
    counts, total = filled_elements(model)
    result["parameters"] = {name: list(p.shape) for name, p in model.named_parameters()}
    result["unloaded"] = sorted(name for name, (filled, _) in counts.items() if filled == 0)
    result["partially_loaded"] = sorted(name for name, (filled, size) in counts.items() if 0 < filled < size)
    result["filled_elements"] = total
    result["exported_elements"] = {name: tensor.numel() for name, tensor in exported.items()}
    mapping = getattr(model, "draft_id_to_target_id", None)
    if mapping is not None and "d2t" in exported:
        result["d2t_equal"] = bool(torch.equal(mapping.data.cpu(), exported["d2t"]))
    result["fields_read"] = field_sources(hf_config, sorted(set(reads)), written)
    result["aux_layer_ids"] = list(get_eagle3_aux_layers_from_config(config.speculative_config) or [])
    result["num_speculative_tokens"] = config.speculative_config.num_speculative_tokens
    inner = getattr(model, "model", None)
    result["mask_token_id"] = getattr(inner, "mask_token_id", None)
    return result


def field_sources(config: Any, names: list[str], written: dict[str, Any]) -> dict[str, Any]:
    """Each config field read (methods left out): ``{"source": "export" | "config" | "default"}`` (written by
    the export; present on vLLM's parsed config without being written, a class default or a value vLLM set;
    absent, so vLLM used its ``getattr`` default), with vLLM's value where it has one."""
    sources = {}
    for name in names:
        value = getattr(config, name, MISSING)
        if callable(value):
            continue
        if value is MISSING:
            sources[name] = {"source": "default"}
            continue
        entry = {"source": "export" if name in written else "config", "value": jsonable(value)}
        if name in written and jsonable(value) != written[name]:
            entry["written"] = written[name]
        sources[name] = entry
    return sources


def jsonable(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except TypeError:
        return repr(value)


def main(requests_path: Path, results_path: Path) -> None:
    # The check builds and loads; the V1 runner's refusal of DSpark concerns running it, which this never does.
    from vllm.config import VllmConfig

    VllmConfig._get_v1_model_runner_unsupported_features = lambda self: []
    results = [check(request) for request in json.loads(requests_path.read_text())]
    results_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
