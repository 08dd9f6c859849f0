"""The mutation gate's planted bugs: each a one-line change to the project that the named tests must catch.

Each entry names the file, its original line (matched whitespace-trimmed; it must occur exactly once, so an
edit that moves or rewrites the line breaks the entry instead of leaving a mutant that tests nothing), the
mutated line (written with the original's indentation) and the pytest node ids that must fail once it is
planted. ``tools/mutants.py`` plants each in a scratch copy of the repository and runs its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    why: str


DSPARK = "tests/families/dspark/test_dspark.py::"
SERVED = "tests/serving/test_served_evaluate.py::test_a_perfect_draft_reaches_the_maximum_acceptance_length"
CHAT_MASKS = "tests/data/test_template_masks.py::"
CHAT_SHAPES = "tests/data/test_chat_shapes.py::"
REGENERATE_AGENT = (
    "tests/workflows/test_regenerate.py::"
    "test_an_agent_conversation_keeps_its_calls_and_results_and_regenerates_its_answers"
)
CONFORMANCE_RELOAD = (
    "tests/families/test_conformance.py::test_export_validates_and_reloads_into_the_same_draft"
)

MUTANTS: tuple[Mutant, ...] = (
    # --- objectives and what they feed -------------------------------------------------------------------
    Mutant(
        "dspark-markov-previous-is-the-label",
        "lightning_drafts/dspark/module.py",
        "supervision.previous,",
        "supervision.labels,",
        ("tests/families/dspark/test_markov_previous.py",),
        "the Markov head sees the answer in training and cheats",
    ),
    Mutant(
        "dspark-labels-unshifted",
        "lightning_drafts/dspark/eval_mask.py",
        "labels=packed.input_ids[rows, (positions + 1).clamp(max=width - 1)],",
        "labels=packed.input_ids[rows, positions.clamp(max=width - 1)],",
        (DSPARK + "test_block_supervision_shifts_labels_by_one_by_hand",),
        "slot k supervised on the token at anchor + k instead of anchor + k + 1",
    ),
    Mutant(
        "dspark-eval-mask-document-end-exclusive",
        "lightning_drafts/dspark/eval_mask.py",
        "in_document = steps <= doc_remaining[rows, anchors][:, None]",
        "in_document = steps < doc_remaining[rows, anchors][:, None]",
        (DSPARK + "test_eval_mask_truncates_at_document_boundaries_by_hand",),
        "`<` for `<=`: a block loses the last token of its document",
    ),
    Mutant(
        "dspark-tau-not-a-chain",
        "lightning_drafts/dspark/metrics.py",
        "tau = 1.0 + accepted.cumprod(dim=1).sum(dim=1)",
        "tau = 1.0 + accepted.sum(dim=1)",
        (DSPARK + "test_acceptance_sums_by_hand",),
        "tau sums per-slot acceptance instead of the accepted prefix",
    ),
    Mutant(
        "block-decay-wrong-rate",
        "lightning_drafts/blockdraft/objective.py",
        "return torch.ones_like(steps) if gamma is None else torch.exp(-steps / gamma)",
        "return torch.ones_like(steps) if gamma is None else torch.exp(-steps * gamma)",
        ("tests/families/dflash/test_dflash.py::test_decayed_cross_entropy_equals_a_naive_weighted_mean",),
        "slot decay exp(-k gamma) instead of exp(-k / gamma)",
    ),
    Mutant(
        "eagle3-gate-off-by-one",
        "lightning_drafts/eagle3/ttt.py",
        "chain_valid = chain_valid & (doc_remaining > step)",
        "chain_valid = chain_valid & (doc_remaining >= step)",
        ("tests/families/eagle3/test_eagle3.py::test_doc_remaining_gate_worked_example",),
        "a TTT step one past the document's end stays supervised (reads the next document)",
    ),
    Mutant(
        "eagle3-loss-mask-ignored",
        "lightning_drafts/eagle3/ttt.py",
        "trainer_loss_mask = shift_left(packed.loss_mask, 1)",
        "trainer_loss_mask = shift_left(packed.attention_mask, 1)",
        ("tests/families/eagle3/test_eagle3.py::test_doc_remaining_gate_worked_example",),
        "prompt tokens supervised: the loss mask is dropped",
    ),
    Mutant(
        "row-max-tail-wins-ties",
        "lightning_drafts/core/row_top.py",
        "later = (tail_top > top) | (tail_top.isnan() & ~top.isnan())",
        "later = (tail_top >= top) | (tail_top.isnan() & ~top.isnan())",
        ("tests/core/test_row_top.py::test_row_max_is_max_over_the_last_dim_bit_for_bit",),
        "a maximum tied between a whole block and the last columns takes the later id: the argmax is not max's",
    ),
    # --- packing, anchors, masks ---------------------------------------------------------------------------
    Mutant(
        "batch-doc-remaining-off-by-one",
        "lightning_drafts/core/batch.py",
        "last_real = doc_start + real_per_doc.gather(1, doc_ids) - 1",
        "last_real = doc_start + real_per_doc.gather(1, doc_ids)",
        ("tests/core/test_batch.py::test_derived_metadata_matches_the_worked_example",),
        "doc_remaining counts one token past each document's end",
    ),
    Mutant(
        "batch-document-boundary-left",
        "lightning_drafts/core/batch.py",
        "doc_ids = torch.searchsorted(ends, positions.contiguous(), right=True)",
        "doc_ids = torch.searchsorted(ends, positions.contiguous(), right=False)",
        ("tests/core/test_batch.py::test_derived_metadata_matches_the_worked_example",),
        "a document's first token is assigned to the previous document",
    ),
    Mutant(
        "anchors-whole-block-too-strict",
        "lightning_drafts/attention/anchors.py",
        "return supervised & (packed.doc_remaining >= block_size - 1)",
        "return supervised & (packed.doc_remaining >= block_size)",
        ("tests/attention/test_anchors.py::test_candidates_by_hand_whole_blocks",),
        "a block ending on its document's last token is never anchored",
    ),
    Mutant(
        "anchors-partial-block-crosses-documents",
        "lightning_drafts/attention/anchors.py",
        "return supervised & next_supervised & (packed.doc_remaining >= 1)",
        "return supervised & next_supervised",
        ("tests/attention/test_anchors.py::test_candidates_by_hand_partial_blocks_for_dspark",),
        "a DSpark anchor on a document's last token predicts the next document's first",
    ),
    Mutant(
        "block-mask-context-sees-the-anchor-successor",
        "lightning_drafts/attention/block_masks.py",
        "visible_context = (kv_idx >= start[block]) & (kv_idx < end[block])",
        "visible_context = (kv_idx >= start[block]) & (kv_idx <= end[block])",
        ("tests/attention/test_block_masks.py::test_dense_mask_equals_the_by_hand_reference",),
        "`<=` for `<`: a block sees one context key past its anchor (the future)",
    ),
    Mutant(
        "target-document-attention-not-causal",
        "lightning_drafts/training/document_target_attention.py",
        "causal=kind.kind == FULL,",
        "causal=False,",
        (
            "tests/training/test_target.py::"
            "test_sdpa_on_the_cpu_attends_per_document_and_equals_each_document_alone",
        ),
        "the frozen target's CPU attention lets a token see the rest of its document (the future)",
    ),
    Mutant(
        "target-gathered-row-spans-from-its-start",
        "lightning_drafts/training/target.py",
        "return tuple((0, start, stop) for start, stop in zip(bounds[:-1], bounds[1:], strict=True))",
        "return tuple((0, 0, stop) for start, stop in zip(bounds[:-1], bounds[1:], strict=True))",
        ("tests/training/test_target.py::test_sdpa_on_the_cpu_runs_the_layers_over_the_real_tokens_alone",),
        "in the gathered row of real tokens, each document attends to every document gathered before it",
    ),
    Mutant(
        "block-draft-last-layer-misses-a-convolution-reach",
        "lightning_drafts/blockdraft/draft.py",
        "attend = _with_earlier_slots(needed, 3 * reach)",
        "attend = _with_earlier_slots(needed, 2 * reach)",
        (
            "tests/families/test_needed_slots.py::"
            "test_needed_slots_equal_the_full_computation_in_value_and_gradient[sdpa-conv-2-taps]",
        ),
        "DFlash2's last layer leaves out queries that a needed slot reads through its three convolutions",
    ),
    Mutant(
        "block-mask-tiles-cross-documents",
        "lightning_drafts/attention/block_masks.py",
        "first_of_document[1:] = starts[1:] != starts[:-1]",
        "first_of_document[1:] = False",
        (
            "tests/attention/test_tiled_attention.py::"
            "test_block_mask_tiles_hold_one_document_each_cut_evenly_and_small_documents_share_one",
        ),
        "the CPU block mask's query tiles run across documents, each computing against both contexts",
    ),
    Mutant(
        "cpu-flash-lse-gradient-carried-with-the-wrong-sign",
        "lightning_drafts/attention/cpu_flash.py",
        "out = torch.cat([out, out.new_full((*out.shape[:-1], 1), -1.0)], dim=-1)",
        "out = torch.cat([out, out.new_full((*out.shape[:-1], 1), 1.0)], dim=-1)",
        ("tests/attention/test_cpu_flash.py",),
        "the CPU flash kernel's log-sum-exp gradient moves D to D + g instead of D - g",
    ),
    Mutant(
        "ttt-diagonal-reads-key-heads-in-repeat-order",
        "lightning_drafts/eagle3/ttt.py",
        "grouped = query.float().unflatten(1, heads)",
        "grouped = query.float().unflatten(1, heads[::-1]).transpose(1, 2)",
        ("tests/families/eagle3/test_eagle3.py::test_ttt_attention_equals_explicit_concatenated_keys",),
        "EAGLE-3's TTT diagonal pairs query head h with key head h % kv_heads instead of h // groups",
    ),
    # --- chat rendering and the supervision mask -------------------------------------------------------------
    Mutant(
        "chat-tool-result-supervised",
        "datamodules/chat_render.py",
        'turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]',
        'turns = [i for i, message in enumerate(messages) if message["role"] in ("assistant", "tool")]',
        (
            CHAT_MASKS + "test_llama31_tool_call_supervised_and_ipython_result_not",
            CHAT_SHAPES + "test_tool_definitions_reach_the_template_unsupervised",
        ),
        "a tool result is supervised as if the target wrote it",
    ),
    Mutant(
        "chat-earlier-turns-supervised-with-their-reasoning",
        "datamodules/chat_render.py",
        "groups = [(through[i], [i]) for i in turns]",
        "groups = [(through[i], turns[: turns.index(i) + 1]) for i in turns]",
        (CHAT_MASKS + "test_qwen3_one_document_per_turn_with_the_earlier_reasoning_removed",),
        "each per-turn document also supervises the earlier turns, keeping an earlier turn's reasoning in the "
        "supervision where Qwen3 serves it without",
    ),
    Mutant(
        "chat-history-rewrite-ignored",
        "datamodules/chat_render.py",
        "if all(full.startswith(through[i]) for i in turns):",
        "if True:",
        (CHAT_MASKS + "test_qwen3_one_document_per_turn_with_the_earlier_reasoning_removed",),
        "a template that rewrites earlier turns still gets one document: the spans of the turns before the "
        "last query point into text the template rewrote",
    ),
    Mutant(
        "chat-reasoning-supervised-regardless",
        "datamodules/chat_render.py",
        "spans += [(start, end)] if supervise_reasoning else [(start, found[0]), (found[1], end)]",
        "spans += [(start, end)]",
        (CHAT_MASKS + "test_qwen3_reasoning_unsupervised_when_asked",),
        "supervise_reasoning=False still supervises the reasoning",
    ),
    Mutant(
        "chat-turn-runs-past-eos",
        "datamodules/chat_render.py",
        "end = stop + len(self.eos)",
        "end = len(through)",
        (CHAT_MASKS + "test_smollm2_default_system_prompt_is_prompt_and_the_turn_ends_at_im_end",),
        "the newline a template writes after the end-of-turn token is supervised, after the target stopped",
    ),
    Mutant(
        "regenerate-rewrites-tool-call-turns",
        "lightning_drafts/workflows/regenerate.py",
        'return message["role"] == "assistant" and not message.get("tool_calls")',
        'return message["role"] == "assistant"',
        (REGENERATE_AGENT,),
        "regenerate writes a new turn over a recorded tool call, which the recorded result no longer answers",
    ),
    Mutant(
        "regenerate-prompt-without-tools",
        "lightning_drafts/workflows/regenerate.py",
        "render_prompt(so_far, template, tokenizer, tools=source.tools, **kwargs),",
        "render_prompt(so_far, template, tokenizer, tools=None, **kwargs),",
        (REGENERATE_AGENT,),
        "an agent's answers regenerated from a prompt without the tool definitions serving renders",
    ),
    Mutant(
        "chat-row-written-back-as-openai",
        "datamodules/chat_format.py",
        'if conversation.key == "conversations":',
        'if conversation.key == "sharegpt":',
        (CHAT_SHAPES + "test_a_row_written_back_reads_as_the_same_conversation_in_its_input_format",),
        "regenerate writes a ShareGPT input back as OpenAI messages, not in the input's format",
    ),
    # --- acceptance estimator --------------------------------------------------------------------------------
    Mutant(
        "acceptance-prefix-not-chained",
        "lightning_drafts/core/acceptance.py",
        "hits = (correct & valid).long().cumprod(dim=1).sum(dim=0)",
        "hits = (correct & valid).long().sum(dim=0)",
        (
            "tests/core/test_acceptance.py::"
            "test_prefix_counts_stop_at_the_first_miss_and_drop_chains_cut_by_the_document_end",
        ),
        "a hit after a miss still counts as accepted",
    ),
    Mutant(
        "acceptance-length-without-the-bonus-token",
        "lightning_drafts/core/acceptance.py",
        "return 1.0 + ratio.sum()",
        "return ratio.sum()",
        ("tests/core/test_acceptance.py::test_acceptance_length_hand_values",),
        "the target's bonus token left out of the acceptance length",
    ),
    Mutant(
        "acceptance-states-reset-in-inference-mode",
        "lightning_drafts/core/acceptance.py",
        "with torch.inference_mode(False):",
        "if True:",
        ("tests/training/test_validate_then_fit.py",),
        "a validation's reset leaves states a later fit cannot update",
    ),
    Mutant(
        "served-acceptance-counts-rejected-steps",
        "lightning_drafts/serving/report.py",
        "hits = [int((accepted > k).sum()) for k in range(num_steps)]",
        "hits = [int((accepted >= k).sum()) for k in range(num_steps)]",
        (
            "tests/families/test_conformance.py::"
            "test_a_trained_export_decodes_losslessly_with_served_and_tau_sim_side_by_side[DFlashModule-qwen3-default]",
        ),
        "served prefix rates count a round that stopped at step k as reaching it",
    ),
    Mutant(
        "served-acceptance-definitions-swapped",
        "lightning_drafts/serving/served_table.py",
        "return pooled, (sum(own) / len(own) if own else None)",
        "return (sum(own) / len(own) if own else None), pooled",
        (
            "tests/serving/test_served_table.py::test_pooled_and_per_request_acceptance_differ_as_computed_by_hand",
        ),
        "the pooled (vLLM, SGLang) and per-request (SpecForge) acceptance lengths are reported under each other's name",
    ),
    Mutant(
        "mt-bench-category-dropped",
        "lightning_drafts/serving/prompt_sets.py",
        'Conversation("mt-bench", row["category"], str(row["question_id"]), tuple(row["turns"]))',
        'Conversation("mt-bench", "all", str(row["question_id"]), tuple(row["turns"]))',
        ("tests/serving/test_prompt_sets.py::test_mt_bench_is_the_80_two_turn_questions_in_8_categories",),
        "MT-Bench results are no longer split by category",
    ),
    Mutant(
        "second-turn-without-the-first-answer",
        "lightning_drafts/serving/evaluate.py",
        "answers[i].append(own)  # the target's own answer, asked about in the next turn",
        "answers[i].append([])",
        (
            "tests/serving/test_prompt_set_evaluate.py::"
            "test_mt_bench_turns_follow_the_targets_answers_and_split_by_category",
        ),
        "a later turn is asked without the target's own answer to the turn before",
    ),
    Mutant(
        "speculative-sampling-redraws-the-rejected-token",
        "lightning_drafts/serving/sampling.py",
        "residual[[tokens[c] for c in children]] = 0",
        "residual[[tokens[c] for c in children]] = residual[[tokens[c] for c in children]]",
        (
            "tests/serving/test_speculative_sampling.py::"
            "test_the_acceptance_rule_emits_each_token_with_its_target_probability",
        ),
        "a rejected proposal is drawn again from p instead of the residual: sampled output no longer follows the target",
    ),
    Mutant(
        "sampled-rounds-verified-at-temperature-one",
        "lightning_drafts/serving/decode.py",
        "probs = sampling.probabilities(target.logits(verified.last_hidden_state[context - 1 :]))",
        "probs = Sampling(1.0, sampling.top_p).probabilities(target.logits(verified.last_hidden_state[context - 1 :]))",
        (
            "tests/serving/test_sampled_rounds.py::"
            "test_each_sampled_round_emits_its_accepted_draft_tokens_and_accepts_with_the_targets_probability",
        ),
        "drafted tokens are verified against the untempered target: accepted as often as temperature 1 accepts",
    ),
    Mutant(
        "served-callback-logs-a-constant",
        "lightning_drafts/workflows/served_acceptance.py",
        "return report.served.accept_len",
        "return 1.0",
        (
            "tests/serving/test_served_acceptance_callback.py::test_a_perfect_draft_logs_the_maximum_served_acceptance_length",
        ),
        "val/served_accept_len no longer measures the export",
    ),
    Mutant(
        "checkpoint-digest-depends-on-order",
        "lightning_drafts/core/digest.py",
        "for key in sorted(value, key=repr):",
        "for key in value:",
        ("tests/serving/test_integrity.py::test_a_checkpoint_records_a_digest_of_every_section",),
        "a checkpoint whose state dict another writer ordered differently is refused as damaged",
    ),
    # --- export, reload and served decoding, per family -----------------------------------------------------
    Mutant(
        "eagle3-export-layer-ids-shifted",
        "lightning_drafts/eagle3/export.py",
        "**layer_id_fields(target_layer_ids),",
        "**layer_id_fields([i + 1 for i in target_layer_ids]),",
        ("tests/families/eagle3/test_eagle3.py::test_export_round_trips_in_the_llama_eagle3_serving_layout",),
        "the serving config names the layers one above the trained ones",
    ),
    Mutant(
        "eagle3-reload-keeps-fresh-weights",
        "lightning_drafts/eagle3/reload.py",
        "module.draft.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=True)",
        "module.draft.load_state_dict(module.draft.state_dict(), strict=True)",
        (CONFORMANCE_RELOAD + "[Eagle3Module-llama-default]",),
        "the reloaded module keeps its initial weights",
    ),
    Mutant(
        "eagle3-served-ignores-d2t",
        "lightning_drafts/eagle3/speculate.py",
        "return draft_id + self.draft.d2t[draft_id]",
        "return draft_id",
        (SERVED + "[Eagle3Module]",),
        "served proposals read draft ids as target ids",
    ),
    Mutant(
        "eagle3-lm-head-starts-from-the-first-target-rows",
        "lightning_drafts/eagle3/draft_base.py",
        "rows = weight.index_select(0, self.selected_token_ids.to(weight.device))",
        "rows = weight[: self.draft_vocab_size]",
        (
            "tests/families/eagle3/test_lm_head_init.py::"
            "test_target_init_copies_the_targets_rows_of_the_draft_vocabulary",
        ),
        "a draft LM head started from the target gets the rows of ids 0..V_d-1, not of its vocabulary",
    ),
    Mutant(
        "dflash-export-causal",
        "lightning_drafts/dflash/export.py",
        "is_causal=False,",
        "is_causal=True,",
        ("tests/families/dflash/test_dflash.py::test_export_round_trips_and_has_the_serving_layout",),
        "engines read the non-causal block draft as causal",
    ),
    Mutant(
        "dflash-served-draft-weights-not-loaded",
        "lightning_drafts/dflash/reload.py",
        "draft.to(dtype).load_state_dict(state, strict=True)",
        "draft.to(dtype)",
        (SERVED + "[DFlashModule]",),
        "the served draft runs its random initial weights",
    ),
    Mutant(
        "dflash-served-pad-for-mask",
        "lightning_drafts/dflash/speculate.py",
        "block = torch.cat([anchor, anchor.new_full((slots - 1,), self.mask_token_id)])",
        "block = torch.cat([anchor, anchor.new_full((slots - 1,), 0)])",
        (SERVED + "[DFlash2Module]",),
        "served blocks fill slots 1..K-1 with the pad id instead of the mask token",
    ),
    Mutant(
        "dspark-export-wrong-mask-token",
        "lightning_drafts/dspark/export.py",
        '"mask_token_id": fields["mask_token_id"],',
        '"mask_token_id": 0,',
        (SERVED + "[DSparkModule-specforge]",),
        "the SpecForge layout records the pad id as the mask token",
    ),
    Mutant(
        "dspark-reload-drops-the-markov-head",
        "lightning_drafts/dspark/reload.py",
        "draft.load_state_dict({k: v.to(reference[k].dtype) for k, v in state.items()}, strict=False)",
        "draft.load_state_dict({k: v.to(reference[k].dtype) for k, v in state.items() "
        'if not k.startswith("markov_head.")}, strict=False)',
        (CONFORMANCE_RELOAD + "[DSparkModule-qwen3-specforge]",),
        "a reload keeps the module's initial Markov head",
    ),
    Mutant(
        "dspark-served-pad-for-mask",
        "lightning_drafts/dspark/speculate.py",
        "block = torch.cat([anchor, anchor.new_full((self.block_size - 1,), self.mask_token_id)])",
        "block = torch.cat([anchor, anchor.new_full((self.block_size - 1,), 0)])",
        (SERVED + "[DSparkModule-nemo]",),
        "served blocks fill slots 1..K-1 with the pad id instead of the mask token",
    ),
    # --- the GPU paths -------------------------------------------------------------------------------------
    Mutant(
        "block-spread-in-the-inputs-dtype",
        "lightning_drafts/blockdraft/draft.py",
        "flat = rows.new_zeros(like.shape[0] * like.shape[1], rows.shape[-1])",
        "flat = like.new_zeros(like.shape[0] * like.shape[1], rows.shape[-1])",
        (
            "tests/families/test_needed_slots.py::"
            "test_a_subset_layers_output_keeps_the_kernels_dtype_under_autocast",
        ),
        "float32 zeros take bf16 rows: CUDA's index_copy refuses them and a bf16-mixed block draft stops",
    ),
    Mutant(
        "target-router-left-in-bf16",
        "lightning_drafts/training/target.py",
        "kept = self._float32_kept",
        "kept = {}",
        ("tests/training/test_rope_tables.py::test_the_moe_router_stays_float32_in_a_bf16_target",),
        "a bf16 DeepSeek-V3 target routes with a bf16-rounded router: other experts than the served target's",
    ),
    Mutant(
        "target-float16-only-tensors-kept-in-bf16",
        "lightning_drafts/training/target.py",
        "if self.model.get_input_embeddings().weight.dtype == torch.float16:",
        "if True:",
        (
            "tests/training/test_rope_tables.py::"
            "test_tensors_kept_float32_only_in_float16_follow_from_pretrained",
        ),
        "a bf16 gpt-oss target keeps its norms float32, which from_pretrained and vLLM keep in bf16",
    ),
    Mutant(
        "eagle3-rope-table-left-in-bf16",
        "lightning_drafts/eagle3/rope.py",
        "if self.inv_freq.dtype != torch.float32:",
        "if False:",
        ("tests/training/test_rope_tables.py::test_the_drafts_rope_tables_undo_an_in_place_buffer_cast",),
        "after FSDP1's in-place buffer cast the EAGLE-3 draft rotates with a bf16 table",
    ),
    Mutant(
        "mask-kind-blind-to-a-none",
        "lightning_drafts/attention/backends.py",
        'closed_over.append(mask_kind(value) if hasattr(value, "__code__") else value is None)',
        'closed_over.append(mask_kind(value) if hasattr(value, "__code__") else False)',
        ("tests/attention/test_compile_variants.py::test_mask_kinds_tell_apart_what_dynamo_guards",),
        "a window and no window share one compiled entry point (a guard variant each)",
    ),
    # --- what two equal runs cannot show --------------------------------------------------------------------
    Mutant(
        "step-draws-blind-to-the-rank",
        "lightning_drafts/training/step_draws.py",
        "key = json.dumps([int(seed), stage, int(step), int(rank), int(micro_batch)]).encode()",
        "key = json.dumps([int(seed), stage, int(step), int(micro_batch)]).encode()",
        ("tests/training/test_step_draws.py::test_each_input_of_the_key_changes_the_draws",),
        "every rank draws the same anchors: a resumed run repeats them as faithfully as the uninterrupted one",
    ),
    Mutant(
        "step-draws-one-validation-micro-batch",
        "lightning_drafts/training/step_draws.py",
        'micro_batch = batch_idx % accumulate if stage == "train" else batch_idx',
        'micro_batch = batch_idx % accumulate if stage == "train" else 0',
        (
            "tests/training/test_step_draws.py::test_a_fits_micro_batches_are_keyed_by_their_place_in_the_step",
        ),
        "every validation batch of a step draws the same anchors (the global step stays put in validation)",
    ),
    Mutant(
        "target-worker-weights-unchecked",
        "lightning_drafts/training/remote/worker_identity.py",
        '"weights",',
        '# "weights",',
        (
            "tests/training/test_worker_identity.py::"
            "test_a_worker_holding_another_random_target_of_the_same_config_is_refused_by_its_weights",
        ),
        "a worker holding another target of the same config (other weights) serves the trainer's features",
    ),
    Mutant(
        "target-worker-field-of-one-side-unchecked",
        "lightning_drafts/training/remote/worker_identity.py",
        "if identity.get(field) != expected.get(field):",
        "if field in expected and identity.get(field) != expected[field]:",
        (
            "tests/training/test_worker_identity.py::test_a_worker_differing_in_one_field_is_refused_naming_it",
        ),
        "a worker that loaded a GGUF file serves a trainer that did not (the file digest on one side only)",
    ),
    Mutant(
        "checkpoint-missing-section-passes",
        "lightning_drafts/training/checkpoint_integrity.py",
        "if name not in skip and (name not in checkpoint or value_digest(checkpoint[name]) != digest)",
        "if name not in skip and name in checkpoint and value_digest(checkpoint[name]) != digest",
        (
            "tests/serving/test_integrity.py::"
            "test_a_checkpoint_missing_a_whole_section_is_refused_naming_the_file_and_the_section",
        ),
        "a checkpoint without its loops or optimizer state resumes from step 0 or with fresh moments, silently",
    ),
    Mutant(
        "checkpoint-with-its-digests-removed-read-unverified",
        "lightning_drafts/training/checkpoint_integrity.py",
        "    if recorded is None and digested:",
        "    if recorded is None and digested and False:",
        (
            "tests/serving/test_integrity.py::"
            "test_a_checkpoint_whose_digests_were_removed_is_refused_and_one_that_never_had_them_is_named",
        ),
        "a checkpoint whose digest map was removed is read as one written before digests, unverified",
    ),
    Mutant(
        "moved-class-refuses-its-own-old-checkpoints",
        "lightning_drafts/training/checkpoint_integrity.py",
        "if recorded is None or recorded == expected or recorded in tuple(former):",
        "if recorded is None or recorded == expected:",
        (
            "tests/test_architecture.py::"
            "test_a_checkpoint_of_the_old_layout_loads_and_exports_byte_identical[dflash2-None]",
        ),
        "a DFlash2 checkpoint written before the class moved to its own file is refused as another family",
    ),
    Mutant(
        "checkpoint-without-weights-left-to-lightning",
        "lightning_drafts/training/module.py",
        "if strategy is not None and type(strategy) not in (SingleDeviceStrategy, DDPStrategy):",
        "if strategy is not None or True:",
        (
            "tests/serving/test_integrity.py::"
            "test_a_checkpoint_without_its_weights_is_refused_outside_the_cli_naming_them",
        ),
        "a checkpoint without its weights is a bare KeyError from Lightning outside the CLI",
    ),
    Mutant(
        "resumed-plan-counts-units-from-its-start",
        "datamodules/packing.py",
        "units_after = start + np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])",
        "units_after = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])",
        (
            "tests/data/test_datamodule.py::"
            "test_a_second_and_a_third_mid_epoch_resume_still_use_every_document_once",
        ),
        "a resumed run's checkpoint records the units since the resume: its own resume deals them again",
    ),
    Mutant(
        "resumed-position-counted-twice",
        "datamodules/loader.py",
        "return int(units_after[min(max(position - self.skip, 0), len(units_after) - 1)])",
        "return int(units_after[min(max(position, 0), len(units_after) - 1)])",
        (
            "tests/data/test_datamodule.py::"
            "test_a_second_and_a_third_mid_epoch_resume_still_use_every_document_once",
        ),
        "a resumed run's checkpoint counts the batches before the resume twice: its own resume skips documents",
    ),
    Mutant(
        "preemption-ctrl-c-after-sigterm-stops-at-once",
        "callbacks/preemption.py",
        "if signum == signal.SIGINT and self._signum == signal.SIGINT:",
        "if signum == signal.SIGINT and self._signum is not None:",
        (
            "tests/training/test_repeated_signals.py::"
            "test_a_repeated_signal_saves_the_step_once_and_exits_as_the_first_one",
        ),
        "a Ctrl-C after a scheduler's SIGTERM interrupts the step: nothing saved, exit 1",
    ),
    Mutant(
        "preemption-last-signal-wins",
        "callbacks/preemption.py",
        "if self._signum is None:",
        "if True:",
        (
            "tests/training/test_repeated_signals.py::"
            "test_a_repeated_signal_saves_the_step_once_and_exits_as_the_first_one",
        ),
        "a Ctrl-C after a SIGTERM turns the exit into 130: the scheduler's signal is no longer what the job reports",
    ),
    # --- the target matrix: packed documents kept apart in every layer kind --------------------------------
    Mutant(
        "target-window-over-the-whole-row",
        "lightning_drafts/attention/layer_kinds.py",
        "return (same_doc & causal & within)[:, None]",
        "return (causal & within)[:, None]",
        (
            "tests/training/test_target_matrix.py::test_packed_features_equal_each_document_alone[gemma3-eager]",
            "tests/training/test_target_matrix.py::test_a_documents_features_do_not_change_with_the_documents_beside_it[mistral-eager]",
        ),
        "a sliding-window layer's mask spans the whole row: a document reads the end of the one before it",
    ),
    Mutant(
        "target-chunks-counted-from-the-row",
        "lightning_drafts/attention/layer_kinds.py",
        "start = doc_start[b, q_idx]",
        "start = 0 * doc_start[b, q_idx]",
        (
            "tests/training/test_target_matrix.py::test_packed_features_equal_each_document_alone[llama4-flex]",
        ),
        "Llama 4's attention chunks start at the row's start, not at each document's",
    ),
    Mutant(
        "target-per-document-window-dropped",
        "lightning_drafts/training/document_target_attention.py",
        "return LayerKind(SLIDING, int(window))",
        "return LayerKind(FULL)",
        (
            "tests/training/test_target_matrix.py::test_packed_features_equal_each_document_alone[mistral-sdpa]",
        ),
        "the per-document CPU attention attends to the whole document where the layer has a sliding window",
    ),
    Mutant(
        "target-linear-state-across-documents",
        "lightning_drafts/training/target.py",
        "if self.runs_documents_alone:",
        "if False:",
        (
            "tests/training/test_target_matrix.py::test_packed_features_equal_each_document_alone[qwen3_next-sdpa]",
            "tests/training/test_target_matrix.py::test_a_documents_features_do_not_change_with_the_documents_beside_it[qwen3_next-eager]",
        ),
        "Qwen3-Next's Gated DeltaNet state and convolution run on along the row into the next document",
    ),
    Mutant(
        "target-logits-without-final-softcap",
        "lightning_drafts/training/target.py",
        'if cap := getattr(config, "final_logit_softcapping", None):',
        "if cap := None:",
        ("tests/training/test_target_logits.py::test_teacher_logits_equal_the_models_own[gemma2]",),
        "a Gemma 2 target's teacher distribution comes from its LM head without the soft-cap its forward applies",
    ),
    Mutant(
        "gguf-target-identity-without-its-file",
        "lightning_drafts/training/target.py",
        "self.file_sha256 = file_sha256(model) if is_gguf(model) else None",
        "self.file_sha256 = None",
        ("tests/gguf/test_gguf_target.py::test_a_changed_gguf_file_is_refused_as_another_target",),
        "a GGUF target's identity leaves out its file, so features and checkpoints of another file are taken as its own",
    ),
    Mutant(
        "target-head-transform-unchecked",
        "lightning_drafts/training/target.py",
        "if gap > 2**-6 * float(own.abs().max()):",
        "if False:",
        (
            "tests/training/test_target_logits.py::test_a_target_whose_logits_the_teacher_cannot_reproduce_is_refused[hyperclovax]",
        ),
        "a target whose forward scales its logits in a way the teacher does not know trains drafts on a wrong distribution",
    ),
    Mutant(
        "target-vision-language-config-as-causal-lm",
        "lightning_drafts/training/auto_model.py",
        "return AutoModelForImageTextToText",
        "return AutoModelForCausalLM",
        (
            "tests/training/test_target_matrix.py::test_packed_features_equal_each_document_alone[qwen3_vl-sdpa]",
        ),
        "a vision-language target (Qwen3-VL) is refused by the causal-LM auto class instead of trained on as text",
    ),
)


def catalog_problems(root: Path, mutants: tuple[Mutant, ...] = MUTANTS) -> list[str]:
    """Why an entry cannot be planted as written (empty when every entry can): its file is missing, its
    original line is not found exactly once (trimmed), it changes nothing, names no test, or a name repeats."""
    problems, names = [], set()
    for mutant in mutants:
        if mutant.name in names:
            problems.append(f"{mutant.name}: the name is used twice")
        names.add(mutant.name)
        path = root / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.name}: {mutant.file} does not exist")
            continue
        found = sum(line.strip() == mutant.original.strip() for line in path.read_text().splitlines())
        if found != 1:
            problems.append(
                f"{mutant.name}: the original line is found {found} times in {mutant.file} (needs exactly once): "
                f"{mutant.original!r}"
            )
        if mutant.mutated.strip() == mutant.original.strip():
            problems.append(f"{mutant.name}: the mutated line equals the original")
        if not mutant.tests or not all(test.startswith("tests/") for test in mutant.tests):
            problems.append(f"{mutant.name}: names no catching test under tests/ ({mutant.tests})")
        if any(test.startswith("tests/mutants/") for test in mutant.tests):
            # The catalog's own test reads the planted file, so it "catches" every mutant.
            problems.append(f"{mutant.name}: the catalog's own tests cannot be a mutant's catching test")
    return problems
