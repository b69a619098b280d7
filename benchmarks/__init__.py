"""Benchmarks of the cache and the kernels.

Run from the repository root as ``python -m benchmarks.<name>``; each module's docstring
says what it measures.
"""
