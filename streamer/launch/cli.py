"""The `sao` command: one subcommand per role, each a module with `main(argv) -> int`."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "up": ("streamer.launch.up",
           "run the whole pipeline on the embedded default (broker, simulator, agents, learner, metrics, dashboard)"),
    "broker": ("streamer.transport.broker", "run the embedded Kafka-protocol broker in the foreground"),
    "topics": ("streamer.launch.topics", "create a run's topics with the project's partition counts"),
    "simulate": ("simulator.run", "generate a task stream from a drift scenario (to a file, a queue or Kafka)"),
    "replay": ("simulator.replay", "replay a recorded task stream (JSONL, Parquet, CSV) with its timing"),
    "record": ("streamer.runs.record", "tap a topic into a task-stream file"),
    "pretrain": ("learner.pretrain", "supervised warm start of the tiny policy"),
    "finetune": ("learner.finetune", "supervised warm start of any HF model on a stream's demonstrations"),
    "toy-model": ("learner.models.toy", "build a small HF model (Qwen3 dense or GLM-4-MoE) and BPE tokenizer locally"),
    "import": ("learner.models.importer",
               "a GGUF file or an HF directory -> a model directory for --model, its end token checked and fixed"),
    "agent": ("streamer.agent.agent", "single-rollout agent: tasks -> trajectories"),
    "learn": ("learner.train", "continuous SAO learner: trajectories -> policy versions"),
    "weights-serve": ("streamer.transport.weight_server", "serve a weight store over HTTP (agents on other hosts)"),
    "eval": ("streamer.agent.evaluator",
             "held-out greedy eval of each policy version -> eval/reward per (family, concept)"),
    "tap": ("streamer.runs.tap", "record a run's topics into its run directory (trajectories, drift, metrics)"),
    "samples": ("streamer.runs.show_samples", "print a run's sample of answers as text (prompt -> answer, reward)"),
    "metrics": ("streamer.metrics.app", "faust metrics app: windowed aggregates -> <run>.metrics"),
    "dashboard": ("dashboard.launch", "Streamlit dashboard"),
}


def pieces(name: str) -> dict[str, object]:
    """What a command needs from a package its own module may not import (docs/architecture.md, the package map:
    imports point one way), handed to its `main` as keyword arguments."""
    if name == "replay":  # the served model's tokenizer, to check prompts against (--model)
        from learner.models.tokenizer import load_tokenizer

        return {"load_tokenizer": load_tokenizer}
    if name == "tap":  # the model's tokenizer, to write the sampled answers as text (--model)
        from learner.models.tokenizer import load_tokenizer

        return {"load_tokenizer": load_tokenizer}
    if name == "record":  # the file formats `sao replay` reads
        from simulator.sinks import file_sink

        return {"file_sink": file_sink}
    if name == "toy-model":  # the texts to train the tokenizer on without --stream
        from simulator.warmstart import scenario_texts

        return {"default_texts": scenario_texts}
    if name == "pretrain":  # the agents' episode loop, for the held-out evaluation
        from streamer.agent.rollouts import run_tasks

        return {"run_tasks": run_tasks}
    return {}


def usage() -> str:
    lines = ["usage: sao <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"sao: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest, **pieces(name)) or 0)


if __name__ == "__main__":
    sys.exit(main())
