"""`sao learn`: the continuous SAO learner (trajectories -> policy versions).

    sao learn --trajectories runs/x/trajectories.jsonl --checkpoint-dir runs/x/ckpt   # replay a recording
    sao learn --run exp1 --bootstrap 127.0.0.1:9092 --weights-dir runs/exp1/weights     # live, from Kafka
    sao learn ... --set io.weights_transport=http --set io.weights_bind=0.0.0.0:8765    # a weight server: agents
                                           # elsewhere run sao agent --model http://LEARNER-HOST:8765/latest
    sao learn --config learner.yaml --set loss.name=ppo --set batch.tokens=2048 --sync   # overrides
    sao learn --config runs/x/config.yaml                                                # a run's learner section
    sao learn --backend megatron --nproc 2 --set backend.expert_parallel=2 --trajectories ...  # megatron, 2 ranks

Restarting with the same checkpoint directory resumes where the last checkpoint left off.

The megatron backend runs one process per rank: `--nproc N` re-executes `sao learn` under
`python -m torch.distributed.run --nproc_per_node N` on this machine; any launcher that sets
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...: torchrun itself, the Ray gang) works too.
Several nodes: the same command on each, with `--nnodes M` and either `--node-rank i --master-addr HOST
--master-port PORT` (HOST: node 0, reachable from every node) or `--rdzv-endpoint HOST:PORT` (torchrun's c10d
rendezvous; it numbers the nodes). Rank 0 alone reads trajectories, publishes and writes the checkpoint's models;
every rank writes its optimizer shard into checkpoint.dir, which must be one directory all nodes share: checked at
start.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from learner.config import LearnerConfig
from streamer.transport.broker import free_port
from streamer.wire.config import EXIT_NO_SPACE, EXIT_REFUSED, ConfigError, Refusal, add_config_args, load_config

log = logging.getLogger("learner.train")
SHARED_FIX = "put it on a filesystem every node mounts at the same path"

FLAGS = {  # command-line flag -> config key
    "trajectories": "io.trajectories", "run": "io.run", "bootstrap": "io.bootstrap", "init": "io.init",
    "weights_dir": "io.weights_dir", "run_dir": "io.run_dir", "checkpoint_dir": "checkpoint.dir",
    "max_steps": "max_steps", "loss": "loss.name", "backend": "backend.name",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sao learn", description=__doc__.split("\n")[0])
    add_config_args(p, "LearnerConfig", "optim.lr=1e-4")
    for flag in FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, help=f"sets {FLAGS[flag]}")
    p.add_argument("--sync", action="store_true", help="synchronous: wait for a full batch of the current version")
    p.add_argument("--follow", action="store_true", help="keep reading the trajectory file as it grows")
    p.add_argument("--from-scratch", action="store_true", help="every checkpoint in checkpoint.dir damaged: move "
                   "them into its damaged/ and start from zero (sets checkpoint.from_scratch)")
    p.add_argument("--nproc", type=int, default=0,
                   help="megatron: run N ranks on this machine (re-executes under torchrun)")
    p.add_argument("--nnodes", type=int, default=1, help="with --nproc: nodes of the job, each running this command")
    p.add_argument("--node-rank", type=int, default=0, help="with --nnodes: this node's index, 0 .. nnodes-1")
    p.add_argument("--master-addr", default="", help="with --nnodes: node 0's address, reachable from every node "
                   "(one node: 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0, help="with --nnodes: a free port on node 0 (one node: any)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of torchrun's c10d rendezvous, instead of "
                   "--node-rank/--master-addr/--master-port (the rendezvous numbers the nodes)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> LearnerConfig:
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAGS.items() if getattr(args, flag) is not None]
    if args.sync:
        overrides.append("batch.sync=true")
    if args.follow:
        overrides.append("io.follow=true")
    if args.from_scratch:
        overrides.append("checkpoint.from_scratch=true")
    return load_config(LearnerConfig, args.config, overrides + args.overrides, section="learner")


def build_models(cfg: LearnerConfig):
    """The models to train, held by the backend `cfg.backend.name` names (`models.backend`), from io.init (and
    io.value_init) or a fresh seeded policy. Megatron joins the ranks' process group: every rank must call it."""
    from learner.backends import make_backend
    from learner.models.lora import add_lora
    from learner.models.policy import build_policy, load_policy
    from learner.models.value import ValueHead, ValueModel

    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.io.init) if cfg.io.init else build_policy(cfg.model, seed=cfg.seed)
    value, lora = None, cfg.policy.lora
    if cfg.uses_value_model and cfg.io.value_init:
        value = ValueModel.load(cfg.io.value_init)
    elif cfg.uses_value_model and cfg.value.kind == "copy":  # copied before LoRA layers rename the policy's weights
        value = ValueModel.from_policy(policy, seed=cfg.seed, layers=cfg.value.layers)
    if lora.r:
        policy = add_lora(policy, lora.r, lora.alpha, lora.dropout, lora.target_modules)
    if cfg.uses_value_model and cfg.value.kind == "head":
        value = ValueHead(policy, cfg.value.detach_backbone, seed=cfg.seed)
    policy.train()
    if value is not None:
        value.train()
    return make_backend(cfg, policy, value).models


def build_source(cfg: LearnerConfig):
    from learner.trainer.source import BusSource, FileSource

    if cfg.io.trajectories:
        return FileSource(cfg.io.trajectories, follow=cfg.io.follow)
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.schema import Trajectory
    from streamer.wire.settings import ClientSettings
    from streamer.wire.topics import Topics, partitions_by_topic

    # its own consumer name: the tap (`sao-tap`) dead-letters the same records, and each skips only its own letters
    bus = KafkaBus(cfg.io.bootstrap or None, ClientSettings(client_id="sao-learner"))
    bus.create_topics(partitions_by_topic(cfg.io.run))
    topics = Topics(cfg.io.run)
    return BusSource(bus.consumer({topics.trajectories: Trajectory}, group_id=None, dlq=topics.dlq))


class JsonlSink:
    """LearnerEvents as JSON lines, flushed per event (a crash loses none already emitted)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "ab+")
        self.f.seek(0, 2)
        if self.f.tell():  # a kill -9 mid-line: end that line so the next event starts clean
            self.f.seek(-1, 2)
            if self.f.read(1) != b"\n":
                self.f.write(b"\n")

    def __call__(self, event) -> None:
        from streamer.wire.schema import encode_json

        self.f.write(encode_json(event) + b"\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class TableSink:
    """LearnerEvents as rows of the run's learner table; the trainer flushes it before each checkpoint (a kill
    after the checkpoint loses no row of a step it does not redo)."""

    def __init__(self, writer, row) -> None:
        self.writer, self.row = writer, row

    def __call__(self, event) -> None:
        self.writer.add(self.row(event))

    def flush(self) -> None:
        self.writer.flush()


def build_outputs(cfg: LearnerConfig):
    """(publisher or None, event sinks, closers). With `io.weights_transport` http, the weight server too (a daemon
    thread of this process, rank 0; `streamer.transport.weight_server`), closed by its closer; with broadcast, the
    weight server and the sender of rank 0's group (`streamer.transport.weight_broadcast`)."""
    from learner.models.tokenizer import load_tokenizer
    from learner.trainer.publish import DirectoryPublisher

    jsonl = JsonlSink(cfg.io.events or Path(cfg.checkpoint.dir) / "events.jsonl")
    sinks, closers, announcer = [jsonl], [jsonl.close], None
    if cfg.io.run_dir:
        from streamer.runs.artifacts import TableWriter, learner_row

        table = TableSink(TableWriter(cfg.io.run_dir, "learner", writer_id="learner"), learner_row)
        sinks.append(table)
        closers.append(table.flush)
    if not cfg.io.trajectories:  # live: announce versions and events on the run's topics
        from streamer.transport.kafka_bus import KafkaBus
        from streamer.transport.weights import Announcer
        from streamer.wire.topics import Topics

        producer, topics = KafkaBus(cfg.io.bootstrap or None).producer(), Topics(cfg.io.run)
        sinks.append(lambda e: (producer.send(topics.learner, e), producer.flush()))
        announcer = Announcer(producer, cfg.io.run)
        closers.append(producer.close)
    tokenizer = load_tokenizer(cfg.io.init) if cfg.io.init else None
    base_uri, broadcast = "", None
    if cfg.io.weights_dir and cfg.io.weights_transport in ("http", "broadcast"):  # before version 0 is published
        from streamer.transport.weight_server import WeightServer

        server = WeightServer(cfg.io.weights_dir, cfg.io.weights_bind, "LearnerConfig.io.weights_bind").start()
        closers.append(server.close)
        base_uri = f"http://{cfg.io.weights_advertised or server.address}"
    if cfg.io.weights_dir and cfg.io.weights_transport == "broadcast":  # and rank 0's group with the agents
        from streamer.transport.weight_broadcast import Broadcaster

        sender = Broadcaster(cfg.io.weights_group_bind, cfg.io.weights_bucket_bytes, cfg.io.weights_group_timeout_s,
                             "LearnerConfig.io.weights_group_bind").start()
        closers.append(sender.close)
        broadcast = sender.offer
    publisher = DirectoryPublisher(cfg.io.weights_dir, announcer, cfg.io.versions_kept(), tokenizer,
                                   cfg.io.weights_chunk_bytes, base_uri, broadcast,
                                   adapters_only=cfg.policy.lora.publish == "adapters") if cfg.io.weights_dir else None
    return publisher, sinks, closers


LAUNCH_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-endpoint")


def check_nodes(args: argparse.Namespace) -> None:
    """ConfigError for a node layout torchrun could not join; a warning for loopback across nodes."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: need nnodes >= 1 and 0 <= "
                          "node-rank < nnodes")
    if args.nnodes > 1 and not args.nproc:
        raise ConfigError(f"--nnodes {args.nnodes}: give --nproc too (the ranks of this node)")
    if args.rdzv_endpoint:
        if args.master_addr or args.master_port or args.node_rank:
            raise ConfigError("--rdzv-endpoint: the rendezvous numbers the nodes and hosts the store; leave out "
                              "--node-rank, --master-addr and --master-port")
        if not args.rdzv_endpoint.rpartition(":")[2].isdigit():
            raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint}: give HOST:PORT")
    elif args.nnodes > 1 and not (args.master_addr and args.master_port):
        raise ConfigError(f"--nnodes {args.nnodes}: every node needs --master-addr (node 0's address, reachable "
                          "from the others) and --master-port, or use --rdzv-endpoint HOST:PORT")
    host = args.master_addr or args.rdzv_endpoint.rpartition(":")[0]
    if args.nnodes > 1 and _loopback(host):
        print(f"sao learn: warning: {host} is a loopback address: only nodes on this machine can reach it",
              file=sys.stderr)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def torchrun_argv(argv: list[str], nproc: int, args: argparse.Namespace | None = None,
                  run_id: str = "sao") -> list[str]:
    """`sao learn argv` (less the launcher's flags) as `nproc` ranks of this node under torchrun: one node
    (127.0.0.1 and a free port unless given), several by --node-rank/--master-addr/--master-port, or by a
    c10d --rdzv-endpoint (`run_id`: the rendezvous id, the same on every node)."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in LAUNCH_FLAGS:
            skip = True
        elif not a.startswith(tuple(f"{f}=" for f in LAUNCH_FLAGS)):
            rest.append(a)
    args = args or parse_args([])
    nodes = ["--nnodes", str(args.nnodes)]
    if args.rdzv_endpoint:
        nodes += ["--rdzv_backend", "c10d", "--rdzv_endpoint", args.rdzv_endpoint, "--rdzv_id", run_id]
    else:
        port = args.master_port or free_port()
        nodes += ["--node_rank", str(args.node_rank), "--master_addr", args.master_addr or "127.0.0.1",
                  "--master_port", str(port)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *nodes,
            "-m", "streamer.launch.cli", "learn", *rest]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        cfg = build_config(args)
        if args.nproc and cfg.backend.name != "megatron":
            raise ConfigError("--nproc: only the megatron backend runs as several ranks; add --backend megatron")
        if args.nproc < 0:
            raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
        check_nodes(args)
    except ConfigError as e:
        print(f"sao learn: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
        return 0
    if args.nproc and "RANK" not in os.environ:  # not yet a rank: become N of them
        return subprocess.call(torchrun_argv(argv, args.nproc, args, cfg.io.run or "sao-learn"))
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(name)s{f' rank {rank}' if rank else ''} %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    torch.set_num_threads(cfg.threads)
    try:
        return train(cfg)
    except ConfigError as e:
        print(f"sao learn: {e}", file=sys.stderr)
        return EXIT_REFUSED if isinstance(e, Refusal) else 2
    except Exception as e:
        from learner.trainer.checkpoint import is_no_space

        if not is_no_space(e):
            raise
        print(f"sao learn: {e}", file=sys.stderr)  # a restart cannot help: a distinct code (sao up's supervisor)
        return EXIT_NO_SPACE


def train(cfg: LearnerConfig) -> int:
    from learner.trainer.loop import Trainer

    if cfg.io.init and not Path(cfg.io.init).exists():
        raise ConfigError(f"io.init={cfg.io.init}: not found on {socket.gethostname()} (rank "
                          f"{os.environ.get('RANK', '0')}); every rank loads it: {SHARED_FIX}, or copy it there")
    models = build_models(cfg)
    group = models.backend.group
    leader = group is None or group.leader
    if group is not None:  # every rank writes its optimizer shard into the leader's checkpoint directory
        error = group.check_shared("learner.checkpoint.dir", cfg.checkpoint.dir, f"every rank writes its "
                                   f"optimizer state into it: {SHARED_FIX} (sao learn --checkpoint-dir)")
        if not error and cfg.io.weights_dir:  # and its shard of each version into the weight store
            error = group.check_shared("learner.io.weights_dir", cfg.io.weights_dir, f"every rank writes its part "
                                       f"of each version into it: {SHARED_FIX} (sao learn --weights-dir)")
        if error:
            models.backend.shutdown()
            raise ConfigError(error)
    source = build_source(cfg) if leader else None
    publisher, sinks, closers = build_outputs(cfg) if leader else (None, [], [])
    trainer = Trainer(cfg, models, source, publisher, sinks)
    trainer.install_signal_handlers()
    resumed = trainer.resume()
    log.info("%s at step %d, version %d", "resumed" if resumed else "starting", trainer.step, trainer.version)
    try:
        n = trainer.run()
    finally:
        for close in closers:
            close()
        if source is not None:
            source.close()
        models.backend.shutdown()
    log.info("done: %d steps this run, step %d, version %d, counts %s", n, trainer.step, trainer.version,
             dict(trainer.admission.counts + trainer.counters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
