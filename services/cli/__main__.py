"""``python -m services.cli``: the ``sandstream`` command (as the console script runs it)."""

from services.cli.main import main

main()
