"""``python -m services.processor``: one lifecycle processor until SIGINT/SIGTERM."""

from services.processor.consumer import main

main()
