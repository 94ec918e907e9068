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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from learner.config import LearnerConfig
from streamer.wire.config import ConfigError, add_config_args, load_config

log = logging.getLogger("learner.train")

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
    p.add_argument("--nproc", type=int, default=0,
                   help="megatron: run N ranks on this machine (re-executes under torchrun)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> LearnerConfig:
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAGS.items() if getattr(args, flag) is not None]
    if args.sync:
        overrides.append("batch.sync=true")
    if args.follow:
        overrides.append("io.follow=true")
    return load_config(LearnerConfig, args.config, overrides + args.overrides, section="learner")


def build_models(cfg: LearnerConfig):
    """The models to train, held by the backend `cfg.backend.name` names (`models.backend`), from io.init (and
    io.value_init) or a fresh seeded policy. Megatron joins the ranks' process group: every rank must call it."""
    from learner.backends import make_backend
    from learner.models.policy import build_policy, load_policy
    from learner.models.value import ValueModel

    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.io.init) if cfg.io.init else build_policy(cfg.model, seed=cfg.seed)
    value = None
    if cfg.uses_value_model and cfg.io.value_init:
        value = ValueModel.load(cfg.io.value_init)
    elif cfg.uses_value_model:
        value = ValueModel.from_policy(policy, seed=cfg.seed, layers=cfg.value.layers)
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
    from streamer.wire.topics import Topics, partitions_by_topic

    bus = KafkaBus(cfg.io.bootstrap or None)
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


def build_outputs(cfg: LearnerConfig):
    """(publisher or None, event sinks, closers). With `io.weights_transport` http, the weight server too (a daemon
    thread of this process, rank 0; `streamer.transport.weight_server`), closed by its closer."""
    from learner.models.tokenizer import load_tokenizer
    from learner.trainer.publish import DirectoryPublisher

    jsonl = JsonlSink(cfg.io.events or Path(cfg.checkpoint.dir) / "events.jsonl")
    sinks, closers, announcer = [jsonl], [jsonl.close], None
    if cfg.io.run_dir:
        from streamer.runs.artifacts import TableWriter, learner_row

        table = TableWriter(cfg.io.run_dir, "learner", writer_id="learner")
        sinks.append(lambda e: table.add(learner_row(e)))
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
    base_uri = ""
    if cfg.io.weights_dir and cfg.io.weights_transport == "http":  # before version 0 is published (Trainer.start)
        from streamer.transport.weight_server import WeightServer

        server = WeightServer(cfg.io.weights_dir, cfg.io.weights_bind, "LearnerConfig.io.weights_bind").start()
        closers.append(server.close)
        base_uri = f"http://{cfg.io.weights_advertised or server.address}"
    publisher = DirectoryPublisher(cfg.io.weights_dir, announcer, cfg.io.versions_kept(), tokenizer,
                                   cfg.io.weights_chunk_bytes, base_uri) if cfg.io.weights_dir else None
    return publisher, sinks, closers


def torchrun_argv(argv: list[str], nproc: int) -> list[str]:
    """`sao learn argv` (less --nproc) as `nproc` local ranks under torchrun."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "streamer.launch.cli", "learn", *rest]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        cfg = build_config(args)
        if args.nproc and cfg.backend.name != "megatron":
            raise ConfigError("--nproc: only the megatron backend runs as several ranks; add --backend megatron")
        if args.nproc < 0:
            raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
    except ConfigError as e:
        print(f"sao learn: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
        return 0
    if args.nproc and "RANK" not in os.environ:  # not yet a rank: become N of them
        return subprocess.call(torchrun_argv(argv, args.nproc))
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(name)s{f' rank {rank}' if rank else ''} %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    torch.set_num_threads(cfg.threads)
    try:
        return train(cfg)
    except ConfigError as e:
        print(f"sao learn: {e}", file=sys.stderr)
        return 2


def train(cfg: LearnerConfig) -> int:
    from learner.trainer.loop import Trainer

    models = build_models(cfg)
    group = models.backend.group
    leader = group is None or group.leader
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
