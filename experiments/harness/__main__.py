"""The simulated harness on the first tasks of a scenario's stream: summary, by-phase table, recoveries, steps.

    .venv/bin/python -m experiments.harness --init runs/cache/warmstart-XXXX --scenario default --limit 2000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from experiments.harness.config import SimConfig
from experiments.harness.loop import simulate
from experiments.harness.report import by_phase, summary
from experiments.harness.streams import phase_prefix, scenario_stream
from simulator.scenario import load_scenario, resolve_path
from streamer.wire.config import load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="warm-start policy directory")
    p.add_argument("--scenario", default="default")
    p.add_argument("--limit", type=int, default=2000, help="the first tasks of the stream")
    p.add_argument("--sim", action="append", default=[], metavar="KEY=VALUE", help="SimConfig field")
    p.add_argument("--set", dest="learner", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--agent-set", dest="agent", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="", help="write <out>.json (summary, by-phase table, recoveries, steps)")
    a = p.parse_args(argv)
    sim = load_config(SimConfig, None, a.sim)
    scn = load_scenario(resolve_path(a.scenario))
    stream = phase_prefix(scenario_stream(scn, sim.seed, a.limit), sim.group_size)
    res = simulate(sim, a.init, stream, a.learner, a.agent, scn.rate)
    out = {"sim": dataclasses.asdict(sim), "summary": summary(res, sim.threads), "by_phase": by_phase(res.trajectories),
           "recoveries": res.recoveries.to_dict("records"), "steps": res.steps.to_dict("records")}
    print(json.dumps(out["summary"], indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".json").write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
