"""``python -m lightning_drafts``: the ``lightning-drafts`` command."""

from lightning_drafts.cli.main import main

main()
