"""`sao samples`: print a run's sample of answers (runs/<run>/samples.jsonl, `streamer.runs.samples`).

    sao samples exp1                      # the latest 4 answers of each (family, concept, phase)
    sao samples exp1 --concept add -n 2 --phase 1
    sao samples runs/exp1                 # a run directory's path works too

One line per answer: family/concept, phase, policy version, reward, then prompt -> answer (line breaks shown as
'\\n', the prompt's start cut when it is long: it ends with the question).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamer.runs.layout import ArtifactError
from streamer.runs.samples import SAMPLES_FILE, AnswerSample, latest_per_key, read_samples

PROMPT_CHARS = 120  # of the prompt shown on the line (its end)


def one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_sample(s: AnswerSample, prompt_chars: int = PROMPT_CHARS) -> str:
    head = f"{s.family}/{s.concept}  phase {s.phase}  v{s.policy_version}  reward {s.reward:+.2f}"
    if not s.decoded:
        return f"{head}  task {s.task_id}: (no text: the tap had no tokenizer)"
    prompt = one_line(s.prompt)
    if len(prompt) > prompt_chars:
        prompt = "…" + prompt[-(prompt_chars - 1):]
    return f"{head}  {prompt} -> {one_line(s.answer)}"


def select(samples: list[AnswerSample], concept: str | None = None, phase: int | None = None,
           family: str | None = None, n: int = 4) -> list[AnswerSample]:
    """The latest `n` samples of each (family, concept, phase) that matches the filters."""
    kept = [s for s in samples if (concept is None or s.concept == concept) and (phase is None or s.phase == phase)
            and (family is None or s.family == family)]
    return latest_per_key(kept, n, lambda s: (s.family, s.concept, s.phase))


def run_dir_of(run: str, runs: str) -> Path:
    """`run` as a directory's path, else as a name under `runs`."""
    for d in (Path(run), Path(runs) / run):
        if d.is_dir():
            return d
    raise ArtifactError(f"run '{run}': neither a directory nor a run in {Path(runs).resolve()}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sao samples", description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run name (under --runs) or run directory")
    ap.add_argument("--runs", default="runs", help="runs directory (default: runs)")
    ap.add_argument("--concept", default=None, help="only this concept")
    ap.add_argument("--phase", type=int, default=None, help="only this phase")
    ap.add_argument("--family", default=None, help="only this family")
    ap.add_argument("-n", type=int, default=4, help="latest answers per (family, concept, phase) (default: 4)")
    args = ap.parse_args(argv)
    try:
        d = run_dir_of(args.run, args.runs)
        samples = read_samples(d)
    except ArtifactError as e:
        print(f"sao samples: {e}", file=sys.stderr)
        return 1
    if not samples:
        print(f"sao samples: {d / SAMPLES_FILE}: no answers recorded (yet)", file=sys.stderr)
        return 1
    shown = select(samples, args.concept, args.phase, args.family, args.n)
    if not shown:
        print("sao samples: no answer matches the filters", file=sys.stderr)
        return 1
    for s in shown:
        print(format_sample(s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
