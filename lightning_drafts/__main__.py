from lightning_drafts.cli import main

main()
