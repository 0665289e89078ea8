"""Multi-node launch: each node's torchrun command (parsed back with torchrun's own argument
parser and the engine's), host files, and the SLURM batch script."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

import autoplan
from autoplan.models.registry import resolve
from autoplan.multinode import LaunchError, node_commands, read_hosts, sbatch_script
from engine.run import build_parser as engine_parser
from tests.workflow_helpers import run_cli

SMALL = resolve("gpt", layers=4, hidden=256, heads=8, vocab_size=4096, seq_len=256)


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    """A 4-node plan on DGX A100 nodes (8 GPUs each)."""
    plan = autoplan.estimate(SMALL, "dgx-a100", nodes=4, global_batch=64, tp=2, pp=2)
    return plan.save(tmp_path_factory.mktemp("launch") / "plan.json")


@pytest.fixture(scope="module")
def plan(plan_path):
    return autoplan.Plan.load(plan_path)


def test_c10d_commands(plan, plan_path):
    cmds = node_commands(plan, plan_path, master_addr="node001", steps=50, out_dir="/shared/r")
    assert [c.node_rank for c in cmds] == [0, 1, 2, 3]
    assert len({c.argv for c in cmds}) == 1          # c10d: the same command on every node
    argv = cmds[0].argv
    assert argv[0] == "torchrun"
    args = get_args_parser().parse_args(list(argv[1:]))
    assert (args.nnodes, args.nproc_per_node) == ("4", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "node001:29500")
    assert args.rdzv_id.startswith("autoplan-")
    assert args.module and args.training_script == "engine.run"
    engine = engine_parser().parse_args(args.training_script_args)
    assert engine.plan == str(plan_path.resolve())
    assert (engine.steps, engine.out_dir) == (50, "/shared/r")
    assert cmds[0].shell.startswith(f"cd {cmds[0].cwd} && torchrun --nnodes=4 ")
    assert (Path(cmds[0].cwd) / "engine" / "run.py").exists()


def test_static_rendezvous_from_a_hosts_file(plan, plan_path, tmp_path):
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("# cluster\ngpu-a\ngpu-b  # rack 2\n\ngpu-c\ngpu-d\ngpu-e\n")
    hosts, notes = read_hosts(hosts_file, 4)
    assert hosts == ["gpu-a", "gpu-b", "gpu-c", "gpu-d"] and "first 4" in notes[0]
    cmds = node_commands(plan, plan_path, hosts=hosts, rdzv="static", port=29600)
    for i, c in enumerate(cmds):
        args = get_args_parser().parse_args(list(c.argv[1:]))
        assert c.host == hosts[i]
        assert (args.node_rank, args.master_addr, args.master_port) == (i, "gpu-a", 29600)
        assert args.nnodes == "4" and args.nproc_per_node == "8"
    hosts_file.write_text("gpu-a\ngpu-b\n")
    with pytest.raises(LaunchError, match="2 host"):
        read_hosts(hosts_file, 4)


def test_head_node_placeholder_and_bad_options(plan, plan_path):
    cmd = node_commands(plan, plan_path)[0]
    assert '"--rdzv-endpoint=${MASTER_ADDR:?' in cmd.shell     # expanded by the node's shell
    with pytest.raises(autoplan.errors.ConfigError, match="--port"):
        node_commands(plan, plan_path, port=70000)
    with pytest.raises(LaunchError, match="3 host"):
        node_commands(plan, plan_path, hosts=["a", "b", "c"])


def test_slurm_script(plan, plan_path):
    text = sbatch_script(plan, plan_path, steps=20, time="01:00:00", partition="gpu")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=01:00:00",
                 "#SBATCH --partition=gpu"):
        assert line in lines
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert "srun torchrun \\" in lines
    for piece in ("--nnodes=4", "--nproc_per_node=8", "--rdzv-backend=c10d",
                  '--rdzv-endpoint="$head_node:29500"', '--rdzv-id="$SLURM_JOB_ID"',
                  f"-m engine.run {plan_path.resolve()} --steps 20"):
        assert piece in text
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_cpu_plan_has_no_gpus_per_node(tmp_path):
    cpu = autoplan.estimate(SMALL, "local-cpu", nodes=2, global_batch=8)
    text = sbatch_script(cpu, cpu.save(tmp_path / "cpu.json"))
    assert "--gpus-per-node" not in text and "#SBATCH --nodes=2" in text


def test_command(plan_path, tmp_path, capsys):
    assert run_cli(["launch", str(plan_path), "--master-addr", "n0", "--steps", "5",
                    "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["nodes"]) == 4 and "--rdzv-endpoint=n0:29500" in doc["nodes"][0]["argv"]
    assert run_cli(["launch", str(plan_path), "--master-addr", "n0"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("torchrun --nnodes=4 --nproc_per_node=8") == 4
    job = tmp_path / "job.sbatch"
    assert run_cli(["launch", str(plan_path), "--slurm", "-o", str(job)]) == 0
    assert "#SBATCH --nodes=4" in job.read_text()
    capsys.readouterr()
    assert run_cli(["launch", str(plan_path), "--slurm", "--master-addr", "n0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert run_cli(["launch", str(plan_path), "--nodes-file", str(tmp_path / "none")]) == 2
    assert "cannot read nodes file" in capsys.readouterr().err
