from lightning_drafts.cli.main import main

main()
