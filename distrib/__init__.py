"""distrib: a data-parallel trainer for PyTorch; one code path from one CPU to many GPU nodes."""

__version__ = "0.1.0"
