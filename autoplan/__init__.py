"""autoplan: an automatic parallelism planner for PyTorch training."""

__version__ = "0.1.0"
