"""``python -m services.processor``: one lifecycle processor until SIGINT/SIGTERM."""

from services.processor.collector import tune_collector
from services.processor.consumer import main

tune_collector()
main()
