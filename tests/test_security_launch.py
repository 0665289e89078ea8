"""Issue 14, findings 2 and 8: written scripts are quoted by construction, names with control
characters are refused at load, cluster names cannot become paths, written files honour the
umask. Each test is the attack: the name that tries to inject a line, the path that tries
to run ``$( )`` when the script runs."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

import autoplan
from autoplan.cluster import Cluster
from autoplan.errors import AutoplanError, ConfigError, PlanError
from autoplan.multinode import node_commands, sbatch_script
from autoplan.multinode.torchrun import HEAD_PLACEHOLDER, NodeCommand
from autoplan.plan import Plan, atomic_write_text

REPO = Path(__file__).resolve().parents[1]
CLUSTER = yaml.safe_load((REPO / "profiles" / "clusters" / "local-cpu.yaml").read_text())


@pytest.fixture(scope="module")
def plan() -> Plan:
    two_nodes = {**CLUSTER, "name": "two-node", "nodes": 2, "devices_per_node": 1}
    return autoplan.estimate("mlp-tiny", Cluster.from_dict(two_nodes), global_batch=8, dp=2)


def _words(line: str) -> list[str]:
    """What a POSIX shell makes of ``line`` (after ``cd X &&``), without running it."""
    return shlex.split(line.split(" && ", 1)[1])


EVIL = ["$(touch /tmp/pwned)", "`id`", "${IFS}x", "a;b", "a\nrm -rf ~", "'", '"$HOME"']


@pytest.mark.parametrize("evil", EVIL)
def test_node_commands_quote_every_word(plan, tmp_path, evil):
    plan_path = tmp_path / f"p{evil}.json"
    for cmd in node_commands(plan, plan_path, out_dir=f"runs/{evil}", rdzv_id=evil,
                             master_addr=None):
        words = _words(cmd.shell)
        assert f"runs/{evil}" in words and f"--rdzv-id={evil}" in words
        assert str(plan_path.resolve()) in words
        # a real shell expands the placeholder word only
        line = "printf '%s\\0' " + cmd.shell.split(" && ", 1)[1]
        out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True,
                             env={"MASTER_ADDR": "head1", "PATH": os.environ["PATH"]})
        assert out.stdout.split("\0")[:-1] == [a.replace(HEAD_PLACEHOLDER, "head1")
                                               for a in cmd.argv]


def test_a_shell_running_the_line_sees_the_words_literally(plan, tmp_path):
    marker = tmp_path / "pwned"
    evil = f"$(touch {marker})"
    cmd = node_commands(plan, tmp_path / "p.json", out_dir=evil, master_addr="h1")[0]
    line = "printf '%s\\n' " + cmd.shell.split(" && ", 1)[1]
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True)
    assert evil in out.stdout.splitlines()
    assert not marker.exists()


def test_placeholder_text_from_the_user_does_not_expand(plan, tmp_path):
    cmd = node_commands(plan, tmp_path / "p.json", out_dir=HEAD_PLACEHOLDER)[0]
    assert _words(cmd.shell)[-1] == HEAD_PLACEHOLDER      # the --out value: quoted
    assert NodeCommand(0, None, ("a${X}",), "/").shell.endswith("'a${X}'")


@pytest.mark.parametrize("host", ["$(id)", "h1;reboot", "h1\nh2", "h 1", "-oProxy=x", ""])
def test_host_names_are_host_names(plan, host, tmp_path):
    with pytest.raises(ConfigError):
        node_commands(plan, tmp_path / "p.json", master_addr=host)
    with pytest.raises(ConfigError):
        node_commands(plan, tmp_path / "p.json", hosts=[host, "h2"])


def test_nodes_file_refuses_shell_in_hosts(plan, tmp_path):
    from autoplan.multinode import read_hosts
    from autoplan.multinode.torchrun import LaunchError

    f = tmp_path / "hosts"
    f.write_text("h1\n$(id)\n")
    with pytest.raises(LaunchError, match="not a host name"):
        read_hosts(f, 2)


@pytest.mark.parametrize("option, value", [("job_name", "x\nrm -rf /"), ("job_name", "a b"),
                                           ("time", "1:00\n#SBATCH --x"), ("time", "$(id)"),
                                           ("partition", "gpu;id"),
                                           ("partition", "a\nb")])
def test_sbatch_header_values_are_refused(plan, tmp_path, option, value):
    with pytest.raises(ConfigError):
        sbatch_script(plan, tmp_path / "p.json", **{option: value})


def test_sbatch_script_quotes_paths(plan, tmp_path):
    marker = tmp_path / "pwned"
    evil = f"$(touch {marker})"
    text = sbatch_script(plan, tmp_path / f"{evil}.json", out_dir=evil, job_name="ok",
                         time="02:00:00", partition="gpu")
    last = text.rstrip().splitlines()[-1]
    assert evil in shlex.split(last) and f"{tmp_path.resolve()}/{evil}.json" in shlex.split(last)
    body = [line for line in text.splitlines() if "touch" in line]
    assert all("'" in line for line in body)


def _with_model_name(plan: Plan, name: str, tmp: Path) -> Path:
    doc = json.loads(plan.to_json())
    doc["model"] = {**doc["model"], "name": name}
    path = tmp / "named.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("name", ["gpt\nrm -rf ~", "mlp\r#SBATCH --x", "a\x00b", "x\x1b[2J"])
def test_plan_names_with_control_characters_are_refused(plan, tmp_path, name):
    with pytest.raises(PlanError, match=r"field 'model\.name'.*control character"):
        Plan.load(_with_model_name(plan, name, tmp_path))


def test_control_characters_anywhere_in_plan_names(plan, tmp_path):
    doc = json.loads(plan.to_json())
    doc["param_placements"] = {"w\nx": {"dp": "Replicate()"}}
    with pytest.raises(PlanError, match="control character"):
        Plan.from_dict(doc, source="p.json")


@pytest.mark.parametrize("name", ["../../..", "a/b", "x\ny", ".hidden", "c:\\x\\..\\y"])
def test_cluster_names_cannot_be_paths(name):
    with pytest.raises(ConfigError, match="field 'name'"):
        Cluster.from_dict({**CLUSTER, "name": name}, source="c.yaml")


def test_written_files_honour_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "a.json", "{}\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o077)
        path = atomic_write_text(tmp_path / "b.json", "{}\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_launch_cli_refuses_unsafe_values(plan, tmp_path, capsys):
    from autoplan.cli import main

    path = plan.save(tmp_path / "p.json")
    assert main(["launch", str(path), "--master-addr", "$(id)"]) == 2
    assert main(["launch", str(path), "--slurm", "--time", "1:00;id"]) == 2
    err = capsys.readouterr().err
    assert "--master-addr" in err and "--time" in err
    assert isinstance(ConfigError("x"), AutoplanError)
