"""Helpers the benchmark programs share (a folder, so ``nox -s bench`` does not run it)."""
