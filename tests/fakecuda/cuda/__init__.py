"""Fake ``cuda`` package for tests (see ../README.md)."""
