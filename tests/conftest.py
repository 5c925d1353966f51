"""Fixtures shared by test modules of both lanes (no sys.path edits: the repository root is on it by pyproject)."""

pytest_plugins = ["tests.helpers.nothing_lost"]  # earlier, folder: a finished run, copied for each test
