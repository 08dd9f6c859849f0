"""Built-in chat templates and the rule that picks the template a run renders with.

Both built-ins wrap each assistant reply (and its end-of-turn marker, so the draft learns to stop) in
``{% generation %}`` tags, which lets the assistant mask come straight from the renderer. The Mistral
template keeps the space after ``[/INST]`` inside the tags: SentencePiece sometimes emits that space as a
token of its own (before digits, say), and the model generates it, so it must be supervised.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

# Mistral v1 style: there is no system role in [INST] chat, so a system message is prepended to the
# next user turn, as Mistral's own reference formatting does. The template does not enforce strict
# user/assistant alternation: real corpora break it, and rejecting such rows would hide data.
MISTRAL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' -}}"
    "{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- ' ' + message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- raise_exception('the mistral template has no role ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# ChatML role tags, for tokenizers that ship no template (base models). The tags are plain text unless
# the tokenizer defines them as special tokens.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"mistral": MISTRAL_TEMPLATE, "chatml": CHATML_TEMPLATE}

_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


def has_generation_tags(template: str) -> bool:
    """Whether the template marks assistant output with ``{% generation %}`` blocks."""
    return _GENERATION_TAG.search(template) is not None


def strip_generation_tags(template: str) -> str:
    """The same template without ``{% generation %}`` markers (renders identical text)."""
    return _GENERATION_TAG.sub("", template)


def resolve_chat_template(chat_template: str | None, tokenizer: PreTrainedTokenizerBase) -> str:
    """The Jinja source to render with: the tokenizer's own, a built-in by name, or a literal template."""
    if chat_template is None:
        own = tokenizer.chat_template
        if isinstance(own, dict):
            own = own.get("default")
        if not own:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has no chat template; pass chat_template= one of "
                f"{sorted(BUILTIN_TEMPLATES)} or a Jinja template string"
            )
        return own
    if chat_template in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[chat_template]
    if "{%" in chat_template or "{{" in chat_template:
        return chat_template
    raise ValueError(
        f"chat_template={chat_template!r} is neither a built-in template ({sorted(BUILTIN_TEMPLATES)}) nor a "
        "Jinja template string; pass one of those, or None to use the tokenizer's own template"
    )
