"""Benchmarks behind ``orchard bench``: measured figures, not timed unit tests."""
