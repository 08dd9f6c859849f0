"""Training: the frozen target, the shared ``DraftModule`` (LightningModule) and the checks of the
hyperparameters several families share."""
