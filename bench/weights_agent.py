"""An agent's weight path as a process of its own, for bench/weights.py and tests/test_weight_broadcast.py.

    python -m bench.weights_agent --transport broadcast --group HOST:PORT --url http://HOST:PORT [--engine DIR]
                                 [--save DIR] [--die-after-bucket V]

The real source (`streamer.transport.weight_client.source_for`: the store, the weight server, or the learner's group
with the server behind it) and, with --engine, a real torch engine. It prints `{"asked": true}` once it asked to
join the group (broadcast), then reads announcements (PolicyVersion JSON, one a line) on stdin and, for each, loads
the version from its source into the engine and prints `{"version", "from", "digest", "dtypes", "seconds",
"written", "done_at"}` (`digest`: `weight_group.state_digest` of what it loaded; `written`: files opened for
writing meanwhile).
--save writes what it received as safetensors (for the test to compare tensor by tensor). --die-after-bucket V kills
this process (SIGKILL) when the first bucket of version V has arrived: a real death in the middle of a transfer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import msgspec


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="broadcast")
    p.add_argument("--group", default="")
    p.add_argument("--url", default="")
    p.add_argument("--dir", default="", help="directory transport: the weight store")
    p.add_argument("--engine", default="", help="a model directory: load each version into a torch engine")
    p.add_argument("--save", default="")
    p.add_argument("--die-after-bucket", type=int, default=-1)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from streamer.transport.weight_client import source_for
    from streamer.transport.weight_group import state_digest
    from streamer.wire.schema import PolicyVersion
    from streamer.wire.settings import AgentSettings

    s = AgentSettings(weights_transport=a.transport, weights_url=a.url, weights_group=a.group,
                      weights_dir=a.dir or "unused", agent_id=f"agent{os.getpid()}")
    s.validate()
    source = source_for(s)
    receiver = getattr(source, "receiver", None)
    if receiver is not None and a.die_after_bucket >= 0:
        done = receiver._done

        def die(i: int) -> None:
            done(i)
            if receiver.progress and receiver.progress[0] == a.die_after_bucket:
                os.kill(os.getpid(), signal.SIGKILL)

        receiver._done = die
    engine = None
    if a.engine:
        from learner.engines import make_engine

        engine = make_engine("torch", a.engine)
    if receiver is not None:
        while not receiver.counts["joins"]:
            time.sleep(0.01)
    print(json.dumps({"asked": True, "pid": os.getpid()}), flush=True)
    written: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and (
                (args[1] and any(c in args[1] for c in "wax+")) or (isinstance(args[2], int) and args[2] & 0o3)):
            written.append(args[0])

    sys.addaudithook(audit)
    for line in sys.stdin:
        pv = msgspec.json.decode(line.strip(), type=PolicyVersion)
        written.clear()
        t0 = time.perf_counter()
        state = source.load(pv)
        if engine is not None:
            engine.load_state_dict(state, pv.version)
        seconds, done_at = time.perf_counter() - t0, time.time()
        out = {"version": pv.version, "from": getattr(source, "last_from", "") or a.transport, "seconds": seconds,
               "done_at": done_at, "digest": state_digest(state),
               "dtypes": sorted({str(t.dtype) for t in state.values()}),
               "written": list(written), "engine_version": int(engine.version) if engine is not None else None}
        if a.save:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(a.save, f"v{pv.version}.safetensors"))
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
