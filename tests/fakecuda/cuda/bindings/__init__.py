"""Fake ``cuda.bindings`` for tests (see ../../README.md)."""

__version__ = "0.0.0+fake"
