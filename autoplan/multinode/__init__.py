"""Multi-node launch: ``autoplan launch PLAN`` prints each node's torchrun command
(:mod:`.torchrun`) or writes a SLURM batch script (:mod:`.slurm`)."""

from autoplan.multinode.slurm import sbatch_script
from autoplan.multinode.torchrun import LaunchError, NodeCommand, node_commands, read_hosts

__all__ = ["LaunchError", "NodeCommand", "node_commands", "read_hosts", "sbatch_script"]
