"""The target on its own Ray workers: the remote feed of target features, its workers and its cache."""
