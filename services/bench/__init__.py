"""The benchmarks (``python -m services.bench``, ``make bench``): figures are printed, never
asserted. Tools for people measuring sandstream locally; imports whatever it measures.
"""
