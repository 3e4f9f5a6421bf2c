"""The imperative shell of sandstream: processor, executor, API, CLI and tools."""
