"""Test doubles shipped with the package (used by the test suite, never by the CLI)."""
