"""FrozenTarget: the frozen Hugging Face causal LM a draft learns from, run with packed documents isolated."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PreTrainedModel

from lightning_drafts.attention.backends import (
    additive_mask,
    block_causal_mask,
    block_mask_from_mask_mod,
    document_causal_mask_mod,
    resolve_backend,
)
from lightning_drafts.attention.layer_kinds import (
    FULL,
    LayerKind,
    document_kind_mask,
    document_kind_mask_mod,
    layer_kinds,
)
from lightning_drafts.core.batch import PackedBatch, varlen_layout
from lightning_drafts.core.checks import is_int
from lightning_drafts.core.digest import state_digest
from lightning_drafts.core.row_top import row_max
from lightning_drafts.core.target_features import FeatureRequest, TargetFeatures, final_position_mask
from lightning_drafts.gguf import file_sha256, is_gguf, load_gguf_model
from lightning_drafts.shipped import resolve_shipped
from lightning_drafts.training.auto_model import target_model_class
from lightning_drafts.training.decoderless import load_without_decoder
from lightning_drafts.training.document_target_attention import DOCUMENT_ATTENTION, SPANS_ARGUMENT

TargetSpec = str | dict | PreTrainedModel

# Our backend names -> transformers' attention implementation names.
HF_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention", "flash": "flash_attention_2"}


@dataclass(frozen=True)
class TargetOutput:
    """What one frozen forward gives a draft.

    ``hidden_states[i]`` is the output of decoder layer ``layer_ids[i]`` (HF ``hidden_states[l + 1]``),
    ``[B, T, H]`` each; ``last_hidden_state`` is the final-norm output the LM head reads. From captured
    features it holds the final-norm output only where ``last_hidden_mask`` is set (``None``: everywhere);
    read it through :meth:`final_states`, which refuses a position the capture did not store.
    """

    hidden_states: tuple[Tensor, ...]
    last_hidden_state: Tensor
    last_hidden_mask: Tensor | None = None

    def final_states(self, index: Any, needed: Tensor | None = None) -> Tensor:
        """``last_hidden_state[index]``; every position it selects (or those of them ``needed`` flags)
        must hold the target's value."""
        states = self.last_hidden_state[index]
        if self.last_hidden_mask is not None:
            stored = self.last_hidden_mask[index]
            missing = ~stored if needed is None else needed.bool() & ~stored
            if missing.any():
                raise ValueError(
                    f"the target features hold the final hidden state at fewer positions than this draft reads "
                    f"({int(missing.sum())} missing); capture again with this draft's config (its "
                    "final_positions), or run the target with final=True"
                )
        return states

    @classmethod
    def without_final(
        cls, hidden_states: tuple[Tensor, ...], shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> TargetOutput:
        """Outputs of ``[B, T]`` rows (``shape``) that hold no final state: ``last_hidden_state`` of width 0
        and a mask that makes :meth:`final_states` refuse every position."""
        return cls(
            hidden_states=hidden_states,
            last_hidden_state=torch.zeros(*shape, 0, dtype=dtype, device=device),
            last_hidden_mask=torch.zeros(*shape, dtype=torch.bool, device=device),
        )

    @classmethod
    def from_features(
        cls, features: TargetFeatures, layer_ids: Sequence[int], dtype: torch.dtype
    ) -> TargetOutput:
        """The output a live forward would give, from a batch's captured ``features`` (cast to ``dtype``,
        the target's compute dtype); ``layer_ids`` must be among the captured layers."""
        missing = [i for i in layer_ids if i not in features.layer_ids]
        if missing:
            raise ValueError(
                f"the batch's target features hold layers {list(features.layer_ids)}, not {missing} that this "
                "draft reads; capture with this draft's target_layer_ids"
            )
        captured = features.hidden_states
        width = captured.shape[-1] // max(len(features.layer_ids), 1)
        chunks = dict(zip(features.layer_ids, captured.split(width, dim=-1), strict=True)) if width else {}
        hidden = tuple(chunks[i].to(dtype) for i in layer_ids)
        if features.last_hidden_state is None:
            return cls.without_final(hidden, captured.shape[:2], dtype, captured.device)
        return cls(
            hidden_states=hidden,
            last_hidden_state=features.last_hidden_state.to(dtype),
            last_hidden_mask=features.last_hidden_mask,
        )


def build_causal_lm(
    spec: TargetSpec, dtype: torch.dtype | str | None = None, seed: int = 0, decoder: bool = True
) -> PreTrainedModel:
    """A causal LM from a hub id / local path / ``shipped:<name>`` / ``.gguf`` file (dequantized, in
    ``dtype`` or float32), a config dict (random weights, seeded), or an instance. ``decoder=False`` loads a checkpoint (hub id / path) without its decoder layers
    (:mod:`lightning_drafts.training.decoderless`); a config dict or an instance is built whole (random
    weights are drawn in the full model's order)."""
    if isinstance(spec, PreTrainedModel):
        return spec
    if isinstance(spec, dict):
        fields = dict(spec)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(
                f"a target config dict needs 'model_type' (e.g. 'llama', 'qwen3'), got keys {sorted(spec)}"
            )
        config = AutoConfig.for_model(model_type, **fields)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = target_model_class(config).from_config(config, dtype=as_dtype(dtype))
        return model
    if isinstance(spec, str):
        if is_gguf(spec):
            # A GGUF file is read whole (its tensors are dequantized together); FrozenTarget then frees the
            # decoder when it is not wanted.
            return load_gguf_model(spec, dtype=as_dtype(dtype))
        if not decoder:
            return load_without_decoder(resolve_shipped(spec), dtype=as_dtype(dtype) or "auto")
        path = resolve_shipped(spec)
        return target_model_class(AutoConfig.from_pretrained(path)).from_pretrained(
            path, dtype=as_dtype(dtype) or "auto"
        )
    raise ValueError(
        f"target must be a hub id / local path (str), a config dict or a transformers PreTrainedModel, "
        f"got {type(spec).__name__}"
    )


class FrozenTarget(nn.Module):
    """A frozen causal LM: never trains, never caches, and never lets packed documents see each other.

    Args:
        model: hub id / local path, config dict (with ``model_type``; random weights from ``seed``), or
            a ``PreTrainedModel``.
        attn_backend: ``"auto"`` (flash-attn varlen on CUDA if installed, else flex on CUDA, else SDPA),
            or one of ``"sdpa"``, ``"eager"``, ``"flex"``, ``"flash"``. Resolved on the first forward,
            once the device is known; an unavailable explicit choice raises. ``"flex"`` on the CPU runs
            uncompiled (exact, forward only, scores of a whole row at once).
        dtype: parameter dtype (``None`` keeps the model's / checkpoint's).
        seed: the seed of random weights built from a config dict.
        decoder: keep the decoder layers. ``False``: a checkpoint is loaded without them (never read from
            disk); a config dict or an instance is built whole and its decoder weights freed
            (:meth:`release_decoder`). Either way only the embedding, final norm and LM head remain and a
            forward is refused.
    """

    def __init__(
        self,
        model: TargetSpec,
        attn_backend: str = "auto",
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        decoder: bool = True,
    ) -> None:
        super().__init__()
        self.model = build_causal_lm(model, dtype=dtype, seed=seed, decoder=decoder)
        # A GGUF target's weights live in its file alone: its bytes' digest is part of its identity.
        self.file_sha256 = file_sha256(model) if is_gguf(model) else None
        # Taken before any cast: the float32 rope tables and the tensors transformers keeps float32 (a MoE
        # router's weight and score bias), which every later cast is undone to.
        self._rope_tables = float32_rope_tables(self.model)
        self._float32_kept = float32_kept_tensors(self.model)
        self._float32_kept_in_float16 = float32_kept_tensors(self.model, in_float16=True)
        if dtype is not None:
            self.model.to(as_dtype(dtype))
            self.keep_float32_tensors()
        self.model.requires_grad_(False)
        if not decoder:
            self.release_decoder()
        # from_pretrained returns the model in eval mode; the module tree follows its owner's mode like any
        # other module (Lightning warns about eval-mode modules at the start of fit), and forward computes
        # in eval mode whatever that mode is (_evaluating).
        self.model.train(self.training)
        self.requested_backend = attn_backend
        self.backend: str | None = None
        if attn_backend not in ("auto", *HF_ATTENTION):
            raise ValueError(
                f"attn_backend {attn_backend!r} is unknown; choose 'auto' or one of {tuple(HF_ATTENTION)}"
            )
        self._check_head_transform()

    def _apply(self, fn: Any, recurse: bool = True) -> FrozenTarget:
        # Every cast of the module tree (``.to(dtype)``, ``.bfloat16()``, a ``*-true`` precision's
        # ``convert_module``) reaches the rope tables through here.
        super()._apply(fn, recurse)
        self.keep_float32_tensors()
        return self

    def keep_float32_tensors(self) -> None:
        """Give the rotary embeddings back their float32 ``inv_freq`` / ``original_inv_freq`` where a cast
        lowered them (on the device they are on), and the tensors transformers keeps float32 whatever the load
        dtype (``_keep_in_fp32_modules_strict``: DeepSeek-V3's router ``gate.weight`` and
        ``e_score_correction_bias``; a bf16-rounded router picks other experts than the served target at
        near-ties), and in a float16 model those it keeps float32 there only (``_keep_in_fp32_modules``).
        ``from_pretrained(dtype=bfloat16)`` keeps the rope tables float32 and vLLM serves with float32 rope
        tables: rounded to bf16 (relative error ~4e-3), the angle at position
        4095 is off by up to ~0.7 rad and the teacher's features drift from the served target's. Also run
        before every forward, for casts that bypass ``Module._apply`` (FSDP1 casts buffers in place to its
        ``buffer_dtype``)."""
        for (module_name, buffer_name), table in self._rope_tables.items():
            module = self.model.get_submodule(module_name)
            current = module._buffers[buffer_name]
            if current is not None and current.dtype != torch.float32:
                module.register_buffer(buffer_name, table.to(current.device, copy=True), persistent=False)
        kept = self._float32_kept
        if self.model.get_input_embeddings().weight.dtype == torch.float16:
            kept = {**self._float32_kept_in_float16, **kept}
        for name, master in kept.items():
            module_name, _, attribute = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            current = getattr(module, attribute, None)
            if current is None or current.dtype == torch.float32:
                continue
            if attribute in module._parameters:
                # In place (the parameter object stays the one optimizers and strategies hold): frozen, no grad.
                current.data = master.to(current.device, copy=True)
            else:
                persistent = attribute not in module._non_persistent_buffers_set
                module.register_buffer(attribute, master.to(current.device, copy=True), persistent=persistent)

    def state_dict(
        self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """Nothing: no checkpoint holds the frozen target (it is rebuilt from its spec), so no module under it
        is visited and a strategy never gathers or copies a target tensor to save it. FSDP1's full state dict
        unshards each FSDP unit it visits and copies it to rank 0's CPU; FSDP2's (``get_model_state_dict``)
        gathers and copies every tensor it is handed: for Llama-3.1-8B ~16 GB of bf16 weights that
        ``on_save_checkpoint`` would then drop. ``self.model.state_dict()`` still holds the whole model."""
        return OrderedDict() if destination is None else destination

    def outside_decoder(self) -> list[nn.Module]:
        """The modules holding the target's parameters outside its decoder layers (embedding, final norm, LM
        head): what the trainer's process keeps whole when the decoder layers are sharded or released."""
        decoder = {id(module) for module in self.decoder_layers.modules()}
        return [
            module
            for module in self.model.modules()
            if id(module) not in decoder and next(module.parameters(recurse=False), None) is not None
        ]

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def text_config(self) -> Any:
        return self.model.config.get_text_config()

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def num_layers(self) -> int:
        # The config's count, which a target loaded without its decoder layers still records.
        return int(self.text_config.num_hidden_layers)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype its forward computes in (its LM head's), which captured features are cast to."""
        return self.lm_head.weight.dtype

    def identity(self) -> dict[str, Any]:
        """What captured features must come from: the config (its hash; paths, dtype and versions left
        out), the parameter dtype, sizes, and a digest of the frozen tensors a draft still reads at training
        time (input embedding, LM head), which tells two random or fine-tuned targets of one config apart."""
        config = {
            key: value
            for key, value in self.model.config.to_dict().items()
            if not key.startswith("_") and key not in ("dtype", "torch_dtype", "transformers_version")
        }
        if self.file_sha256 is not None:
            # transformers marks a GGUF load with the file's name; the file's digest below identifies it.
            config.pop("quantization_config", None)
        config_json = json.dumps(config, sort_keys=True, default=str)
        config_hash = hashlib.sha256(config_json.encode()).hexdigest()[:32]
        weights = state_digest({"embed": self.input_embeddings.weight, "lm_head": self.lm_head.weight})[:32]
        # In the order a mismatch is best explained: the config first, the weights' bytes last.
        identity = {
            "config_hash": config_hash,
            "dtype": str(self.compute_dtype).removeprefix("torch."),
            "hidden_size": int(self.text_config.hidden_size),
            "num_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "weights": weights,
        }
        if self.file_sha256 is not None:
            # Every decoder weight is in the file: one changed where the embedding and head are not is a
            # different teacher too.
            identity["file_sha256"] = self.file_sha256
        return identity

    @property
    def decoder(self) -> nn.Module:
        """The decoder stack (embedding, layers, final norm) the LM head reads: ``get_decoder()``, or its
        ``model`` where that is the whole causal LM (Llama 4's text model: its base-model prefix names the
        multimodal wrapper's language model, which a text-only model does not hold)."""
        decoder = self.model.get_decoder()
        return self.model.model if decoder is self.model else decoder

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def layer_kinds(self) -> list[LayerKind]:
        """Each decoder layer's attention pattern (full, sliding window, chunked, linear)."""
        return layer_kinds(self.text_config)

    @property
    def runs_documents_alone(self) -> bool:
        """Whether some decoder layer is one no per-document mask isolates (linear attention's recurrent
        state, a layer type :mod:`~lightning_drafts.attention.layer_kinds` does not describe): the target
        then runs each packed document in a forward of its own."""
        return not all(kind.masked for kind in self.layer_kinds)

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def special_token_ids(
        self, names: Sequence[str] = ("eos_token_id", "pad_token_id", "bos_token_id")
    ) -> dict[int, str]:
        """``id -> name`` (``eos``, ``pad``, ...) of the config's special tokens ``names`` (lists flattened;
        an id under several names keeps the first)."""
        special: dict[int, str] = {}
        for name in names:
            ids = getattr(self.text_config, name, None)
            for token in ids if isinstance(ids, (list, tuple)) else [ids]:
                if is_int(token):
                    special.setdefault(token, name.removesuffix("_token_id"))
        return special

    def release_decoder(self) -> None:
        """Free the decoder layers' weights (each becomes an empty tensor of its dtype): a draft trained
        from captured features never runs them, and only the embedding, final norm and LM head stay, on
        the device as in memory. A forward afterwards is refused."""
        for parameter in self.decoder_layers.parameters():
            parameter.data = parameter.data.new_empty(0)
        self.decoder_released = True

    @torch.no_grad()
    def forward(self, packed: PackedBatch, layer_ids: Sequence[int] = (), final: bool = True) -> TargetOutput:
        """Run the whole micro-batch once; capture the outputs of ``layer_ids`` and the final hidden state.

        ``final=False``: the caller reads the captured layers only, so the decoder runs through the deepest
        of them and no further (DFlash's default layers end at ``L - 3``: the last two layers and the final
        norm cost nothing); the output then holds no final state (``last_hidden_state`` of width 0, and
        :meth:`TargetOutput.final_states` refuses every position).
        """
        if getattr(self, "decoder_released", False):
            raise ValueError(
                "this batch carries no target features, but the target's decoder was released "
                "(target_decoder=False); train from a features directory (features_dir) or keep target_decoder"
            )
        self._check_layer_ids(layer_ids)
        self.keep_float32_tensors()
        backend = self._select_backend(packed.input_ids.device)
        self._refuse_dropped_sinks(backend, packed.input_ids.device)
        captured: dict[int, Tensor] = {}
        hooks = [
            self.decoder_layers[i].register_forward_hook(_capture_into(captured, i)) for i in set(layer_ids)
        ]
        through = None if final else max((int(i) for i in layer_ids), default=-1)
        try:
            with _evaluating(self.model), self._decoder_through(through):
                if self.runs_documents_alone:
                    with _compile_stance(backend, packed.input_ids.device):
                        last_hidden = self._forward_each_document(packed, captured)
                elif backend == "flash":
                    last_hidden = self._forward_varlen(packed, captured)
                elif self._per_document(backend, packed.input_ids.device):
                    last_hidden = self._forward_documents(packed, captured)
                else:
                    with _compile_stance(backend, packed.input_ids.device):
                        last_hidden = self._decoder(
                            input_ids=packed.input_ids,
                            position_ids=packed.position_ids,
                            attention_mask=self._document_mask(packed, backend),
                        )
        finally:
            for hook in hooks:
                hook.remove()
        hidden_states = tuple(captured[i] for i in layer_ids)
        if not final:
            return TargetOutput.without_final(
                hidden_states, packed.shape, last_hidden.dtype, last_hidden.device
            )
        return TargetOutput(hidden_states=hidden_states, last_hidden_state=last_hidden)

    @torch.no_grad()
    def forward_with_mask(
        self, input_ids: Tensor, position_ids: Tensor, allowed: Tensor, layer_ids: Sequence[int] = ()
    ) -> TargetOutput:
        """One sequence ``input_ids`` ``[T]`` at ``position_ids`` ``[T]`` where token ``i`` attends to token
        ``j`` exactly where ``allowed[i, j]`` (bool ``[T, T]``): a speculative token tree verified in one
        pass. Outputs are ``[1, T, H]`` as :meth:`forward`'s.

        The mask is dense, so the decoder runs with transformers' own SDPA (or eager) attention for this
        call, whatever backend packed batches use: the packed kernels take document ids, not a tree."""
        if getattr(self, "decoder_released", False):
            raise ValueError(
                "the target's decoder was released (target_decoder=False); it cannot verify a tree"
            )
        width = input_ids.numel()
        if allowed.shape != (width, width) or position_ids.shape != (width,):
            raise ValueError(
                f"a masked forward of {width} tokens needs position_ids [{width}] and allowed [{width}, {width}], "
                f"got {tuple(position_ids.shape)} and {tuple(allowed.shape)}"
            )
        self._check_layer_ids(layer_ids)
        self.keep_float32_tensors()
        backend = "eager" if self._select_backend(input_ids.device) == "eager" else "sdpa"
        mask = allowed[None, None]
        captured: dict[int, Tensor] = {}
        hooks = [
            self.decoder_layers[i].register_forward_hook(_capture_into(captured, i)) for i in set(layer_ids)
        ]
        self.model.set_attn_implementation(HF_ATTENTION[backend])
        try:
            with _evaluating(self.model):
                last_hidden = self._decoder(
                    input_ids=input_ids[None],
                    position_ids=position_ids[None],
                    attention_mask=additive_mask(mask, self.model.dtype) if backend == "eager" else mask,
                )
        finally:
            self.model.set_attn_implementation(HF_ATTENTION[self.backend])
            for hook in hooks:
                hook.remove()
        return TargetOutput(
            hidden_states=tuple(captured[i] for i in layer_ids), last_hidden_state=last_hidden
        )

    @torch.no_grad()
    def features(self, packed: PackedBatch, request: FeatureRequest) -> dict[str, Tensor]:
        """The feature keys of :mod:`lightning_drafts.core.target_features` that ``request`` names for
        ``packed``'s rows, from one forward: zero on padding and where the final state is not needed (what
        a features directory stores and a target worker sends, laid out as the batch)."""
        output = self(packed, request.layer_ids, final=request.final_positions != "none")
        real = packed.attention_mask[..., None]
        batch_size, width = packed.shape
        if output.hidden_states:
            hidden = torch.cat(output.hidden_states, dim=-1) * real
        else:
            hidden = output.last_hidden_state.new_zeros(batch_size, width, 0)
        features = {
            "target_layer_ids": torch.tensor(request.layer_ids, dtype=torch.long),
            "target_hidden_states": hidden,
        }
        if request.final_positions != "none":
            mask = final_position_mask(
                packed.loss_mask, packed.attention_mask, packed.doc_remaining, request.final_positions
            )
            features["target_last_hidden_state"] = output.last_hidden_state * mask[..., None]
            features["target_last_hidden_mask"] = mask
        return features

    @torch.no_grad()
    def logits(self, last_hidden_state: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
        """Teacher logits in the target dtype, over the full vocabulary or only the rows ``vocab_ids``.

        Restricting before the matmul avoids ever materialising ``[B, T, V]`` for a draft vocabulary.
        """
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if vocab_ids is not None:
            weight = weight.index_select(0, vocab_ids)
            bias = None if bias is None else bias.index_select(0, vocab_ids)
        return self._as_model_logits(nn.functional.linear(last_hidden_state, weight, bias))

    def _as_model_logits(self, logits: Tensor) -> Tensor:
        """The LM head's product as the model's own logits: its causal-LM forward scales them (Cohere's
        ``logit_scale``, Granite's ``logits_scaling``) or soft-caps them (Gemma 2's
        ``final_logit_softcapping``) after the head, and a teacher's distribution is the model's. Each is
        monotone, so the greedy token stays the head's argmax."""
        config = self.text_config
        if (scale := getattr(config, "logit_scale", None)) is not None:
            logits = logits * scale
        if (scaling := getattr(config, "logits_scaling", None)) is not None:
            logits = logits / scaling
        if cap := getattr(config, "final_logit_softcapping", None):
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def _check_head_transform(self) -> None:
        """At construction: :meth:`logits` equals the model's own causal-LM logits on a short probe through
        the embedding, the final norm and the head (no decoder layer runs, so this costs nothing and works on
        a target whose decoder was released), or the target is refused. A forward that transforms its LM
        head's product otherwise (HyperCLOVA X multiplies by ``logits_scaling``, Falcon-H1 by
        ``lm_head_multiplier``, a LLaVA-NeXT wrapper applies none of its Granite text model's scaling) would
        teach every draft a wrong distribution in silence. Both sides read the same states, so only the
        transform can part them; 2^-6 of the logits' size is four bf16 roundings. A model built on the meta
        device has nothing to compare, and one whose own forward cannot run here (a float16 model whose final
        norm was kept float32 feeds its head a float32 state) is left to say so at its first forward."""
        weight = self.lm_head.weight
        if weight.is_meta:
            return
        probe = (torch.arange(1, 9, device=weight.device) % self.vocab_size)[None]
        with _evaluating(self.model), self._decoder_through(-1):
            try:
                own = self.model(input_ids=probe, use_cache=False).logits.float()
                ours = self.logits(
                    self._decoder(input_ids=probe, position_ids=torch.arange(8, device=weight.device)[None])
                ).float()
            except RuntimeError:
                return
        gap = float((ours - own).abs().max())
        if gap > 2**-6 * float(own.abs().max()):
            raise ValueError(
                f"{type(self.model).__name__}'s own logits differ from its LM head's product by up to {gap:.3g} "
                f"(largest logit {float(own.abs().max()):.3g}): its forward transforms them in a way the "
                "teacher does not know (it knows Cohere's logit_scale, Granite's logits_scaling and a final "
                "soft-cap), so a draft would learn a wrong distribution; this target is not supported"
            )

    @torch.no_grad()
    def greedy_tokens(self, last_hidden_state: Tensor, chunk_tokens: int = 4096) -> Tensor:
        """Full-vocabulary argmax per position (the first maximal id), computed in chunks so ``[B, T, V]``
        never exists at once; through block maxima (:func:`~lightning_drafts.core.row_top.row_max`), as an
        indexed reduction over the vocabulary is the slow one on CPU."""
        flat = last_hidden_state.reshape(-1, last_hidden_state.shape[-1])
        pieces = [row_max(self.logits(part))[1] for part in flat.split(chunk_tokens)]
        return torch.cat(pieces).reshape(last_hidden_state.shape[:-1])

    @contextmanager
    def _decoder_through(self, last: int | None) -> Iterator[None]:
        """The decoder's layers cut after layer ``last`` for one forward (None: all of them), so that no layer
        after it runs: transformers' decoders run the layers their ``layers`` list holds."""
        decoder = self.decoder
        layers = decoder.layers
        if last is None or last + 1 >= len(layers):
            yield
            return
        decoder.layers = layers[: last + 1]
        try:
            yield
        finally:
            decoder.layers = layers

    def _decoder(self, **inputs: Any) -> Tensor:
        return self.decoder(**inputs, use_cache=False).last_hidden_state

    def _document_mask(self, packed: PackedBatch, backend: str) -> Any:
        """The mask of every layer kind the target has, each cut per document: one mask where all layers
        share a kind, else transformers' ``{layer type: mask}`` mapping (a single custom mask would replace
        the sliding windows and chunks of the layers that have them)."""
        masks = {kind.kind: self._kind_mask(kind, packed, backend) for kind in self.layer_kinds}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _refuse_dropped_sinks(self, backend: str, device: torch.device) -> None:
        """Refuse attention sinks a path would drop or cannot run, on whichever path runs the documents:
        transformers hands flash_attention_2 no sinks (its kernel takes none), and flex on the CPU does not
        run them."""
        # The layers are only walked for the paths that would drop sinks: this runs at every forward.
        dropping = backend == "flash" or (backend == "flex" and device.type == "cpu")
        if not dropping or not self._has_attention_sinks():
            return
        if backend == "flash":
            raise ValueError(
                "the target's attention sinks are dropped by flash-attn varlen (attn_backend='flash'); run it "
                "with attn_backend='flex' on CUDA"
            )
        raise ValueError(
            "the target's attention sinks do not run in flex attention on the CPU (attn_backend='flex'); "
            "run it with attn_backend='eager' on the CPU"
        )

    def _has_attention_sinks(self) -> bool:
        # gpt-oss keeps one learnt sink logit per head as its attention module's ``sinks`` parameter (a
        # linear-attention layer has no ``self_attn``).
        return any(
            isinstance(getattr(getattr(layer, "self_attn", None), "sinks", None), Tensor)
            for layer in self.decoder_layers
        )

    def _kind_mask(self, kind: LayerKind, packed: PackedBatch, backend: str) -> Any:
        if backend == "flex":
            batch, width = packed.shape
            if kind.kind == FULL:
                mask_mod = document_causal_mask_mod(packed.doc_ids)
            else:
                mask_mod = document_kind_mask_mod(kind, packed.doc_ids, packed.doc_start)
            return block_mask_from_mask_mod(mask_mod, batch, width, width, packed.input_ids.device)
        if kind.kind == FULL:
            mask = block_causal_mask(packed.doc_ids)
        else:
            mask = document_kind_mask(kind, packed.doc_ids, packed.doc_start)
        # eager attention adds its mask to the scores, so it must get the additive form.
        return additive_mask(mask, self.model.dtype) if backend == "eager" else mask

    def _forward_varlen(self, packed: PackedBatch, captured: dict[int, Tensor]) -> Tensor:
        """FlashAttention varlen over the real tokens only: padding costs nothing, any batch size works."""
        layout = varlen_layout(packed)
        hidden = self._decoder(
            input_ids=packed.input_ids.reshape(1, -1)[:, layout.token_index],
            position_ids=packed.position_ids.reshape(1, -1)[:, layout.token_index],
            cu_seq_lens_q=layout.cu_seqlens,
            cu_seq_lens_k=layout.cu_seqlens,
            max_length_q=layout.max_seqlen,
            max_length_k=layout.max_seqlen,
        )
        return _back_to_rows(hidden, captured, layout.token_index, packed.shape)

    def _select_backend(self, device: torch.device) -> str:
        backend = resolve_backend(self.requested_backend, device)
        if backend != self.backend:
            try:
                self.model.set_attn_implementation(HF_ATTENTION[backend])
            except ValueError:
                other = (
                    "sdpa" if backend != "sdpa" and getattr(self.model, "_supports_sdpa", False) else "eager"
                )
                raise ValueError(
                    f"transformers runs {type(self.model).__name__} without {HF_ATTENTION[backend]!r} attention, "
                    f"which attn_backend={backend!r} needs; run the target with attn_backend={other!r}"
                ) from None
            self.backend = backend
        return backend

    @staticmethod
    def _per_document(backend: str, device: torch.device) -> bool:
        # On the CPU, ``sdpa`` runs SDPA's own flash kernel once per document, causal
        # (:mod:`lightning_drafts.training.document_target_attention`): a dense [B, 1, T, T] mask (and the
        # float copy SDPA makes of it) would grow with the square of the row width.
        return backend == "sdpa" and device.type == "cpu"

    def _forward_documents(self, packed: PackedBatch, captured: dict[int, Tensor]) -> Tensor:
        """The decoder over the real tokens only, each document attending to itself alone, with the
        per-document attention for this forward only: every other caller of the model (greedy decoding,
        ``generate`` with its cache and masks) keeps plain SDPA.

        The real tokens of every row are gathered into one row, so padding runs through no layer (a
        packed micro-batch's last document rarely fills its row). That row is filled up to a multiple of
        :data:`COMPACT_ROW_MULTIPLE` tokens that no document holds (their attention output is zero and
        nothing reads them): a CPU matmul of a few rows can round otherwise than a taller one (float32
        products of 2 or 7 rows differed in their last bits from the same rows of a 4,096-row product at
        one thread, where 64 rows or more did not), so a document's features do not depend on how few
        tokens share its micro-batch."""
        layout = varlen_layout(packed)
        self.model.set_attn_implementation(DOCUMENT_ATTENTION)
        try:
            hidden = self._documents_in_one_row(packed, layout.token_index, _document_spans(layout))
        finally:
            self.model.set_attn_implementation(HF_ATTENTION[self.backend])
        return _back_to_rows(hidden, captured, layout.token_index, packed.shape)

    def _forward_each_document(self, packed: PackedBatch, captured: dict[int, Tensor]) -> Tensor:
        """One decoder forward per document, each in a row of its own, through the model's own attention
        (whichever backend it runs, on any device) with no mask but its causal one: a linear-attention layer's
        recurrent state and causal convolution run along the whole row they are given, and neither
        transformers' fallbacks of them nor every kernel it may pick takes document bounds; a layer type no
        per-document mask describes (DeepSeek-V4's compressed attention) is cut the same way. Each row is
        filled to a multiple of :data:`COMPACT_ROW_MULTIPLE` after its document (see
        :meth:`_forward_documents`), which no causal layer reads back."""
        layout = varlen_layout(packed)
        hidden: list[Tensor] = []
        layers: dict[int, list[Tensor]] = {}
        # A batch without a real token still runs one (empty) document, so every captured layer has a state.
        for _, start, stop in _document_spans(layout) or ((0, 0, 0),):
            own = layout.token_index[start:stop]
            width = _compact_width(stop - start)
            captured.clear()
            hidden.append(
                self._decoder(
                    input_ids=_gather_row(packed.input_ids, own, width),
                    position_ids=_gather_row(packed.position_ids, own, width),
                )[:, : stop - start]
            )
            for layer_id, state in captured.items():
                layers.setdefault(layer_id, []).append(state[:, : stop - start])
        captured.clear()
        captured.update({layer_id: torch.cat(states, dim=1) for layer_id, states in layers.items()})
        return _back_to_rows(torch.cat(hidden, dim=1), captured, layout.token_index, packed.shape)

    def _documents_in_one_row(
        self, packed: PackedBatch, token_index: Tensor, spans: tuple[tuple[int, int, int], ...]
    ) -> Tensor:
        compact = _compact_width(token_index.numel())
        input_ids, position_ids = (
            _gather_row(values, token_index, compact) for values in (packed.input_ids, packed.position_ids)
        )
        return self._decoder(input_ids=input_ids, position_ids=position_ids, **{SPANS_ARGUMENT: spans})

    def _check_layer_ids(self, layer_ids: Sequence[int]) -> None:
        bad = [i for i in layer_ids if not 0 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(
                f"target layer ids {bad} are outside the target's {self.num_layers} decoder layers "
                f"(valid: 0..{self.num_layers - 1}; ids name layer outputs, HF hidden_states[id + 1])"
            )


# The CPU target's gathered row of real tokens is a multiple of this many (see FrozenTarget._forward_documents).
COMPACT_ROW_MULTIPLE = 64
ROPE_TABLES = ("inv_freq", "original_inv_freq")


def float32_rope_tables(model: nn.Module) -> dict[tuple[str, str], Tensor]:
    """``(module name, buffer name) -> float32 table`` of every rotary embedding in ``model``: its own
    buffer where it is still float32, else the table a fresh rotary module of its config computes (a model
    instance handed over already cast)."""
    tables: dict[tuple[str, str], Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module._buffers.get("inv_freq"), Tensor):
            continue
        fresh = None
        for buffer_name in ROPE_TABLES:
            buffer = module._buffers.get(buffer_name)
            if buffer is None:
                continue
            if buffer.dtype != torch.float32:
                fresh = fresh or type(module)(module.config)
                buffer = fresh._buffers[buffer_name]
            tables[(name, buffer_name)] = buffer.detach().float().clone().cpu()
    return tables


def float32_kept_tensors(model: nn.Module, in_float16: bool = False) -> dict[str, Tensor]:
    """``name -> float32 copy`` of the parameters and buffers that ``model`` keeps float32 by its class's
    ``_keep_in_fp32_modules_strict`` (in any dtype), or with ``in_float16`` by its ``_keep_in_fp32_modules``
    (which ``from_pretrained`` keeps float32 in a float16 model only: gpt-oss's norms are bf16 in a bf16
    model, as vLLM serves them). A pattern names a module path piece, as transformers matches it. One that is
    not float32 now (a model handed over already cast, or built by a transformers release that does not keep
    it) is kept from here on, at the value it has."""
    attribute = "_keep_in_fp32_modules" if in_float16 else "_keep_in_fp32_modules_strict"
    patterns = list(getattr(model, attribute, None) or ())
    if not patterns:
        return {}
    kept = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and any(f".{p}." in f".{name}." for p in patterns):
            kept[name] = tensor.detach().float().cpu()
    return kept


def default_capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default captured layers ``[1, N // 2 - 1, N - 4]``
    (docs/concepts/eagle3.md#captured-layers)."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers or ids != sorted(ids):
        raise ValueError(
            f"a target with {num_layers} layers is too shallow for the default capture layers {ids}; "
            "pass three distinct ascending target_layer_ids explicitly"
        )
    return ids


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in eval mode (no dropout, no MoE training-time routing: the teacher must be exact),
    then give every submodule back its mode.

    The mode is switched per call rather than pinned: Lightning puts the whole module in train mode for
    fit and rightly warns about modules it finds in eval mode then, and a frozen target is no reason
    for that warning to appear on every run."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _compile_stance(backend: str, device: torch.device) -> Any:
    """transformers compiles ``flex_attention`` itself; on the CPU that is inductor's flex kernel, which in
    torch 2.13 returned wrong values and NaN at some row widths (8, 24, 88 and 120 tokens at head size 16)
    on an AVX2 machine, where the eager flex forward is exact. A frozen target needs the forward alone,
    so on the CPU its flex attention runs eager; elsewhere the compiled kernel runs."""
    if backend == "flex" and device.type == "cpu":
        return torch.compiler.set_stance("force_eager")
    return nullcontext()


def _capture_into(store: dict[int, Tensor], layer_id: int):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        state = output[0] if isinstance(output, tuple) else output
        if state.dim() != 3:
            raise ValueError(
                f"decoder layer {layer_id} of the target outputs {tuple(state.shape)}, not one hidden state per "
                "token [batch, tokens, hidden] (several residual streams, as DeepSeek-V4's hyper-connections and "
                "Gemma 3n's AltUp keep): no draft here reads such a layer's features"
            )
        store[layer_id] = state

    return hook


def _document_spans(layout: Any) -> tuple[tuple[int, int, int], ...]:
    """``(row 0, start, stop)`` of every document in a :func:`varlen_layout`'s gathered row of real tokens."""
    bounds = layout.cu_seqlens.tolist()
    return tuple((0, start, stop) for start, stop in zip(bounds[:-1], bounds[1:], strict=True))


def _compact_width(tokens: int) -> int:
    """The width of a gathered row of ``tokens`` real tokens: the next multiple of :data:`COMPACT_ROW_MULTIPLE`."""
    return max(-(-tokens // COMPACT_ROW_MULTIPLE), 1) * COMPACT_ROW_MULTIPLE


def _gather_row(values: Tensor, token_index: Tensor, width: int) -> Tensor:
    """``[1, width]``: the ``token_index`` entries of ``values [B, T]`` first, zeros after."""
    row = values.new_zeros(1, width)
    row[0, : token_index.numel()] = values.reshape(-1)[token_index]
    return row


def _back_to_rows(
    last_hidden: Tensor, captured: dict[int, Tensor], token_index: Tensor, shape: tuple[int, int]
) -> Tensor:
    """The final state ``[1, N, H]`` of a forward over the gathered real tokens (the first
    ``len(token_index)`` of its ``N`` positions) back in the batch's ``[B, T, H]`` rows, zero on padding;
    the ``captured`` layer outputs likewise, in place."""
    real = token_index.numel()
    for layer_id, state in captured.items():
        captured[layer_id] = _scatter_rows(state[0, :real], token_index, *shape)
    return _scatter_rows(last_hidden[0, :real], token_index, *shape)


def _scatter_rows(flat: Tensor, token_index: Tensor, batch: int, width: int) -> Tensor:
    out = flat.new_zeros(batch * width, flat.shape[-1])
    out[token_index] = flat
    return out.reshape(batch, width, -1)


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return resolved
