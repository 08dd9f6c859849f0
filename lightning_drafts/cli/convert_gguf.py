"""``lightning-drafts convert-gguf``: write a GGUF target as the plain Hugging Face folder that vLLM and
SGLang load (training reads the .gguf file itself)."""

from __future__ import annotations

import argparse

from lightning_drafts.cli.arguments import CommandParser

DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-drafts convert-gguf",
        description="Write a GGUF model (dequantized) and its tokenizer as a Hugging Face folder.",
    )
    parser.add_argument("gguf_file", help="the .gguf file (the target a config names)")
    parser.add_argument(
        "output_dir", help="the folder to write (new or empty): config.json, model.safetensors, ..."
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="weights' dtype in the folder (float32, default: the dequantized values exactly)",
    )
    return parser


def convert_gguf_main(args: list[str]) -> None:
    import torch

    from lightning_drafts.gguf import convert_gguf

    parsed = build_parser().parse_args(args)
    out = convert_gguf(parsed.gguf_file, parsed.output_dir, dtype=getattr(torch, parsed.dtype))
    print(f"converted {parsed.gguf_file} -> {out}")
