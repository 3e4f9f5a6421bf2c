"""``python -m services.bench``: see services/bench/main.py."""

from services.bench.main import main

main()
