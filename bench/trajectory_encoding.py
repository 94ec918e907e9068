"""Trajectory encoding: today's msgpack lists against a packed layout (int32 token ids, float32 log-probs, uint8 loss
mask as raw little-endian bytes fields), by trajectory length and vocabulary size.

    .venv/bin/python -m bench.trajectory_encoding [--repeat 2000] [--out runs/bench/trajectory_encoding.json]

Per case: bytes on the wire (raw, and lz4 as the producer compresses by default), encode from the agent's Python
lists (array.array), decode back to lists (a drop-in for today's readers) and decode to numpy arrays (what the learner
builds its tensors from; today's lists through np.asarray). Medians over `--repeat` trajectories, microseconds per
trajectory, one process.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

import msgspec
import numpy as np

from bench.common import git_commit, machine, save_json
from streamer.wire.schema import Message, Trajectory, decode, encode

LENGTHS = (64, 256, 2048)
VOCABS = {"char": 64, "lm151k": 151_936}  # the embedded char model; a Qwen-size vocabulary


class PackedTrajectory(Message, kw_only=True):
    """Trajectory with its three per-token arrays as bytes (the other fields as today)."""

    traj_id: str
    task_id: str
    family: str
    concept: str
    phase: int = 0
    group_id: str = ""
    group_size: int = 1
    prompt_len: int
    tokens: bytes  # int32 little-endian
    loss_mask: bytes  # uint8
    logprobs: bytes  # float32 little-endian
    temperature: float = 1.0
    reward: float
    reward_parts: dict[str, float] = {}
    success: bool = False
    policy_version: int = 0
    policy_versions: list[int] = []
    n_turns: int = 1
    n_tool_calls: int = 0
    agent_id: str = ""
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    gen_seconds: float = 0.0
    env_seconds: float = 0.0


ARRAYS = {"tokens": "<i4", "loss_mask": "u1", "logprobs": "<f4"}  # numpy dtypes, for decoding to arrays
CODES = {"tokens": "i", "loss_mask": "B", "logprobs": "f"}  # the same as array.array codes (to and from lists)
assert [array(c).itemsize for c in CODES.values()] == [4, 1, 4]
_packed_enc, _packed_dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(PackedTrajectory)


def make(n: int, vocab: int, rng: random.Random, prompt_frac: float = 0.25) -> Trajectory:
    prompt = max(1, int(n * prompt_frac))
    now = time.time()
    return Trajectory(traj_id=f"t{rng.random()}:0", task_id="default-1-123", family="arith", concept="add7",
                      prompt_len=prompt, tokens=[rng.randrange(vocab) for _ in range(n)],
                      loss_mask=[0] * prompt + [1] * (n - prompt),
                      logprobs=[0.0] * prompt + [-rng.expovariate(1.0) for _ in range(n - prompt)],
                      reward=1.0, success=True, policy_version=12, policy_versions=[12], agent_id="host-1234",
                      created_at=now, started_at=now, finished_at=now, gen_seconds=0.05)


def encode_packed(t: Trajectory) -> bytes:
    fields = {f: getattr(t, f) for f in t.__struct_fields__}
    for name, code in CODES.items():
        a = array(code, fields[name])
        if sys.byteorder == "big":
            a.byteswap()
        fields[name] = a.tobytes()
    return _packed_enc.encode(PackedTrajectory(**fields))


def decode_packed(raw: bytes, lists: bool) -> PackedTrajectory:
    p = _packed_dec.decode(raw)
    for name, dtype in ARRAYS.items():
        if lists:
            a = array(CODES[name], getattr(p, name))
            if sys.byteorder == "big":
                a.byteswap()
            setattr(p, name, a.tolist())
        else:
            setattr(p, name, np.frombuffer(getattr(p, name), dtype=dtype))
    return p


def decode_msgpack_arrays(raw: bytes) -> Trajectory:
    t = decode(raw, Trajectory)
    for name, dtype in ARRAYS.items():
        setattr(t, name, np.asarray(getattr(t, name), dtype=dtype))
    return t


def timed(fn, items) -> float:
    """Median microseconds of fn(item) over the items (each item timed once)."""
    out = []
    for it in items:
        t0 = time.perf_counter()
        fn(it)
        out.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(out)


def case(n: int, vocab: int, repeat: int, seed: int = 0) -> dict:
    import lz4.frame

    rng = random.Random(seed)
    trajs = [make(n, vocab, rng) for _ in range(max(8, repeat // max(1, n // 64)))]
    old = [encode(t) for t in trajs]
    new = [encode_packed(t) for t in trajs]
    back = decode_packed(new[0], lists=True)  # the packed form keeps every value (log-probs to float32)
    assert back.tokens == trajs[0].tokens and back.loss_mask == trajs[0].loss_mask
    assert np.allclose(back.logprobs, trajs[0].logprobs, rtol=1e-6, atol=1e-7)
    out = {"tokens": n, "vocab": vocab, "trajectories": len(trajs)}
    for name, raws, enc, dec_lists, dec_arrays in (
            ("msgpack_lists", old, encode, lambda r: decode(r, Trajectory), decode_msgpack_arrays),
            ("packed", new, encode_packed, lambda r: decode_packed(r, True), lambda r: decode_packed(r, False))):
        out[name] = {
            "bytes": statistics.median(map(len, raws)),
            "bytes_lz4": statistics.median(len(lz4.frame.compress(r)) for r in raws),
            "encode_us": timed(enc, trajs),
            "decode_lists_us": timed(dec_lists, raws),
            "decode_arrays_us": timed(dec_arrays, raws),
        }
        out[name]["encode_decode_us"] = out[name]["encode_us"] + out[name]["decode_lists_us"]
    o, p = out["msgpack_lists"], out["packed"]
    out["packed_over_msgpack"] = {k: p[k] / o[k] for k in ("bytes", "bytes_lz4", "encode_us", "decode_lists_us",
                                                         "decode_arrays_us", "encode_decode_us")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000, help="trajectories per case at 64 tokens (fewer when longer)")
    ap.add_argument("--out", default="runs/bench/trajectory_encoding.json")
    a = ap.parse_args(argv)
    cases = [case(n, v, a.repeat) for v in VOCABS.values() for n in LENGTHS]
    print(f"{'vocab':>7} {'tokens':>6} | {'bytes':>14} {'lz4 bytes':>14} | {'encode us':>13} {'decode us':>13} "
          f"{'-> arrays us':>13}   (msgpack lists / packed)")
    for c in cases:
        def cell(k: str, f: str = "{:.0f}", o=c["msgpack_lists"], p=c["packed"]) -> str:
            return f"{f.format(o[k]):>6}/{f.format(p[k]):<6}"

        print(f"{c['vocab']:>7} {c['tokens']:>6} | {cell('bytes'):>14} {cell('bytes_lz4'):>14} | "
              f"{cell('encode_us', '{:.1f}'):>13} {cell('decode_lists_us', '{:.1f}'):>13} "
              f"{cell('decode_arrays_us', '{:.1f}'):>13}")
    res = {"what": __doc__.splitlines()[0], "commit": git_commit(), "machine": machine(), "time": time.time(),
           "numpy": np.__version__, "msgspec": msgspec.__version__, "cases": cases}
    print("->", save_json(res, Path(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
