"""The training kernel's contracts: the packed batch, a draft's output, acceptance statistics, exact ratio
metrics, the learning-rate schedule, chunked vocabulary terms and the shared value checks.

Nothing here knows a model, an attention kernel or a draft family.
"""
