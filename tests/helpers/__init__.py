"""The tests' helpers and worker scripts, imported as tests.helpers.NAME (the repository root is on sys.path: pytest's
pythonpath, or PYTHONPATH for subprocesses); config specs name them so: model.factory=tests.helpers.factories:tiny."""
