"""Multi-node launch: ``autoplan launch PLAN`` prints each node's torchrun command
(:mod:`.torchrun`) or writes a SLURM batch script (:mod:`.slurm`)."""

_HOME = {"sbatch_script": "autoplan.multinode.slurm", "LaunchError": "autoplan.multinode.torchrun",
         "NodeCommand": "autoplan.multinode.torchrun",
         "node_commands": "autoplan.multinode.torchrun",
         "read_hosts": "autoplan.multinode.torchrun"}

__all__ = ["LaunchError", "NodeCommand", "node_commands", "read_hosts", "sbatch_script"]


def __getattr__(name: str):
    """Import on first use: registering ``autoplan launch`` (and ``autoplan --help``) then
    does not import torch."""
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
