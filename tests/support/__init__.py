"""What the tests share: builders of tiny targets and drafts, reference computations, bounds and guards.

Nothing here is a test; the test modules, the scripts under ``tests/scripts`` and the benchmarks import it.
"""
