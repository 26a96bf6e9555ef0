"""Subcommands of the ``refattn`` command line, one module each."""
