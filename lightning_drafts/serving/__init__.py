"""Serving: the family seam, export files and their checks, and greedy speculative decoding of an export.

Lower layers (core, attention, training) never import this package; draft families build on it.
"""
