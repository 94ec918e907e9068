"""`sao learn --nproc N --nnodes M`: the megatron learner over several nodes through torchrun's rendezvous. Two
"nodes" on this machine (two `sao learn` launches of one rank each) train in step, node 0 at this host's
non-loopback address when it has one (static rendezvous: --node-rank, --master-addr); given two checkpoint
directories, two nodes joined by the c10d rendezvous stop at start, naming the setting.

(c10d at a non-loopback address on one machine: torch picks the process that hosts the rendezvous store by matching
the endpoint to the machine's hostname, and where that fails, as here, neither does; across real hosts the
endpoint's host must resolve to itself.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_megatron_learn import TRAIN, traj_file  # noqa: F401 (a fixture)

from learner.train import check_nodes, main, parse_args, torchrun_argv
from streamer.transport.weights import WeightStore
from streamer.wire.config import ConfigError, set_args

REPO = Path(__file__).resolve().parents[1]


def test_node_flags_become_torchrun_rendezvous_flags():
    one = torchrun_argv(["--backend", "megatron", "--nproc", "2", "--max-steps", "3"], 2)
    assert one[one.index("--nnodes"):one.index("-m", 3)][:4] == ["--nnodes", "1", "--node_rank", "0"]
    assert one[one.index("--master_addr") + 1] == "127.0.0.1"  # one node: loopback and a free port, as before
    argv = ["--nproc=1", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port=29400",
            "--backend", "megatron"]
    static = torchrun_argv(argv, 1, parse_args(argv))
    assert static[3:13] == ["--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "1", "--master_addr",
                            "10.1.2.3", "--master_port", "29400"]
    assert static[static.index("learn"):] == ["learn", "--backend", "megatron"]  # the ranks get no launcher flag
    argv = ["--nproc", "4", "--nnodes", "3", "--rdzv-endpoint", "head:29400"]
    c10d = torchrun_argv(argv, 4, parse_args(argv), run_id="exp1")
    assert c10d[5:13] == ["--nnodes", "3", "--rdzv_backend", "c10d", "--rdzv_endpoint", "head:29400", "--rdzv_id",
                          "exp1"]
    for bad, message in [(["--nnodes", "2", "--nproc", "1"], "--master-addr"),  # no loopback made up
                         (["--nnodes", "2"], "give --nproc too"),
                         (["--nnodes", "2", "--nproc", "1", "--node-rank", "2", "--master-addr", "h"], "node-rank <"),
                         (["--nproc", "1", "--rdzv-endpoint", "h:1", "--node-rank", "1", "--nnodes", "2"],
                          "leave out --node-rank"),
                         (["--nproc", "1", "--rdzv-endpoint", "h"], "HOST:PORT")]:
        with pytest.raises(ConfigError, match=message):
            check_nodes(parse_args(bad))


def test_loopback_across_nodes_warns(capsys):
    check_nodes(parse_args(["--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "1"]))
    assert "loopback" in capsys.readouterr().err
    assert main(["--backend", "megatron", "--nproc", "1", "--nnodes", "2", *set_args(TRAIN)]) == 2
    assert "every node needs --master-addr" in capsys.readouterr().err


def host_address() -> str:
    """This machine's address on its default route (a UDP connect sends nothing), else 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def two_nodes(traj: Path, root: Path, nodes: list[list[str]], checkpoint_dirs: list[Path]) -> list:
    """Two `sao learn` launches of one rank each (the megatron learner, EP 2 across them), one per "node"."""
    procs = []
    for node, ck in zip(nodes, checkpoint_dirs):
        cmd = [sys.executable, "-m", "streamer.launch.cli", "learn", "--backend", "megatron", "--nproc", "1",
               "--nnodes", "2", *node, "--set", "backend.expert_parallel=2", "--trajectories", str(traj),
               "--checkpoint-dir", str(ck), "--weights-dir", str(root / "w"), "--max-steps", "2", *set_args(TRAIN)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=240)
        out.append((p.returncode, text))
    return out


@pytest.mark.slow  # ~16 s on 2 busy cores (50 s when busier): two torchruns of megatron-core
def test_two_nodes_train_in_step(traj_file, tmp_path):  # noqa: F811
    addr, port = host_address(), free_port()
    nodes = [["--node-rank", str(i), "--master-addr", addr, "--master-port", str(port)] for i in (0, 1)]
    ck = tmp_path / "ck"
    (a, out_a), (b, out_b) = two_nodes(traj_file, tmp_path, nodes, [ck, ck])
    assert a == 0 and b == 0, (out_a[-3000:], out_b[-3000:])
    # rank 0 alone read, published and wrote events: each step once, each version once
    events = [json.loads(line) for line in (ck / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["version"], e["n_trajectories"]) for e in events] == [(1, 1, 7), (2, 2, 7)]
    assert [pv.version for pv in WeightStore(tmp_path / "w").versions()] == [0, 1, 2]
    step = ck / "step_00000002"  # each node its part of the weights and moments (HF naming), into the shared dir
    assert {p.name for p in step.glob("policy.weights.*")} == {
        f"policy.weights.{i:05d}-of-00002.safetensors" for i in (1, 2)}
    assert json.loads((step / "state.json").read_text())["layout"]["world_size"] == 2
    assert not list(ck.glob(".sao-shared-*"))  # the start's check left nothing behind


@pytest.mark.slow  # ~16 s: two torchruns that stop after joining the process group
def test_two_nodes_with_their_own_checkpoint_dirs_stop_at_start_naming_it(traj_file, tmp_path):  # noqa: F811
    endpoint = f"127.0.0.1:{free_port()}"
    results = two_nodes(traj_file, tmp_path, [["--rdzv-endpoint", endpoint]] * 2, [tmp_path / "ck0", tmp_path / "ck1"])
    for rc, out in results:
        assert rc != 0
        assert "learner.checkpoint.dir=" in out and "must be one directory shared by every host" in out, out[-3000:]
        assert "rank 0: does not see the files of rank 1" in out and "rank 1: does not see the files of rank 0" in out
    assert not (tmp_path / "ck0" / "events.jsonl").exists()  # stopped before training
