"""The Qwen3-shaped block drafter DFlash, DFlash2 and DSpark build on, and what their exports share.

Public, named pieces only: a family reuses another's work through this package, never through a
sibling family's folder.
"""
