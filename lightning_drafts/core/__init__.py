"""The training kernel's contracts: the packed batch, a draft's output, acceptance statistics, exact ratio
metrics, the learning-rate schedule, chunked vocabulary terms, the shared value checks and the field rules
construction and export validation both apply.

Nothing here knows a model, an attention kernel or a draft family.
"""
