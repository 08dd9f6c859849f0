"""Packed attention: document masks and the backend choice, the CPU flash kernel and its tiled use, the
block layout and masks of block drafts, and anchor sampling. Every place a cross-document leak could live
is here."""
