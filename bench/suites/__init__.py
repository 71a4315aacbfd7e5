"""One module per suite of ``python -m bench``; each adds its subcommand to the one parser."""
