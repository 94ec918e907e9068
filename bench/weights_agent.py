"""An agent's weight path as a process of its own, for bench/weights.py and tests/test_weight_broadcast.py.

    python -m bench.weights_agent --transport broadcast --group HOST:PORT --url http://HOST:PORT [--engine DIR]
                                  [--save DIR] [--die-after-bucket V]
    python -m bench.weights_agent --transport all --dir STORE --group HOST:PORT --url http://HOST:PORT --engine DIR

The real sources (`streamer.transport.weight_client.source_for`: the store, the weight server, or the learner's group
with the server behind it) and, with --engine, a real torch engine. It reads one JSON object a line on stdin:

    a PolicyVersion                      load it from the source --transport names
    {"via": TRANSPORT, "pv": {...}}      load it from that source (--transport all: directory, http, broadcast);
                                         "digest": false leaves the digest out (the transports verify anyway)
    {"join": true}                       --transport all: make the broadcast source now (it asks to join the group)

and, for each version, loads it into the engine and prints `{"version", "from", "digest", "dtypes", "seconds",
"done_at", "written", "engine_version"}` (`digest`: `weight_group.state_digest` of what it loaded; `seconds`: from
reading the line to the engine holding it; `done_at`: that moment, time.time(); `written`: files opened for writing
meanwhile). It prints `{"asked": true}` once a broadcast source asked to join (at start with --transport broadcast,
after `join` with all), and `{"ready": true}` once the engine is built. --save writes what it received as
safetensors (for a test to compare tensor by tensor). --die-after-bucket V kills this process (SIGKILL) when the
first bucket of version V has arrived: a real death in the middle of a transfer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import msgspec


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _broadcast(s, die_after: int):
    """The broadcast source (asking to join now), and its receiver's fault injection if asked for."""
    from streamer.transport.weight_client import source_for

    source = source_for(s)
    receiver = source.receiver
    if die_after >= 0:
        done = receiver._done

        def die(i: int) -> None:
            done(i)
            if receiver.progress and receiver.progress[0] == die_after:
                os.kill(os.getpid(), signal.SIGKILL)

        receiver._done = die
    while not receiver.counts["joins"]:
        time.sleep(0.01)
    _say({"asked": True, "pid": os.getpid()})
    return source


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="broadcast", choices=["directory", "http", "broadcast", "all"])
    p.add_argument("--group", default="")
    p.add_argument("--url", default="")
    p.add_argument("--dir", default="", help="the weight store (directory transport)")
    p.add_argument("--engine", default="", help="a model directory: load each version into a torch engine")
    p.add_argument("--save", default="")
    p.add_argument("--die-after-bucket", type=int, default=-1)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from streamer.transport.weight_client import HttpWeightSource
    from streamer.transport.weight_group import state_digest
    from streamer.transport.weights import WeightStore
    from streamer.wire.schema import PolicyVersion
    from streamer.wire.settings import AgentSettings

    s = AgentSettings(weights_transport="broadcast" if a.transport == "all" else a.transport, weights_url=a.url,
                      weights_group=a.group, weights_dir=a.dir or "unused", agent_id=f"agent{os.getpid()}")
    s.validate()
    sources = {"directory": WeightStore(s.weights_dir)} if a.dir else {}
    if a.url:
        sources["http"] = HttpWeightSource(s.weights_url, s.weights_timeout_s)
    if a.transport == "broadcast":
        sources["broadcast"] = _broadcast(s, a.die_after_bucket)
    engine = None
    if a.engine:
        from learner.engines import make_engine

        engine = make_engine("torch", a.engine)
    _say({"ready": True})
    written: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and (
                (args[1] and any(c in args[1] for c in "wax+")) or (isinstance(args[2], int) and args[2] & 0o3)):
            written.append(args[0])

    sys.addaudithook(audit)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("join"):
            sources["broadcast"] = _broadcast(s, a.die_after_bucket)
            continue
        source = sources[msg.get("via", a.transport)]
        pv = msgspec.convert(msg.get("pv", msg), type=PolicyVersion)
        written.clear()
        t0 = time.perf_counter()
        state = source.load(pv)
        if engine is not None:
            engine.load_state_dict(state, pv.version)
        seconds, done_at = time.perf_counter() - t0, time.time()
        out = {"version": pv.version, "from": getattr(source, "last_from", "") or msg.get("via", a.transport),
               "seconds": seconds, "done_at": done_at, "digest": state_digest(state) if msg.get("digest", True) else "",
               "dtypes": sorted({str(t.dtype) for t in state.values()}), "written": list(written),
               "engine_version": int(engine.version) if engine is not None else None}
        if a.save:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(a.save, f"v{pv.version}.safetensors"))
        _say(out)
        del state
    return 0


if __name__ == "__main__":
    sys.exit(main())
