"""``python -m services.bench [all|processor|drivers] [--quick]``: the benchmarks."""

from services.bench.processor import main

main()
