"""Authenticated policy announcements: an HMAC-SHA256 over each `PolicyVersion`'s fields with the run's key.

Topics have no authentication: whoever reaches the broker can write `<run>.policy`, and the sha256 an agent checks a
checkpoint against travels in the same message. So the learner signs each announcement (`PolicyVersion.sig`, set by
`streamer.transport.weights.announce`) and every follower checks it before the announcement counts for anything; one
that does not verify is dead-lettered with the reason and counted.

The key: `$SAO_POLICY_KEY` (a string of at least MIN_KEY_CHARS characters, used as its UTF-8 bytes), else the file
`$SAO_POLICY_KEY_FILE` names. `sao up` makes one per run (`run_key`: `runs/<run>/policy.key`, mode 0600, reused by a
resumed run or a restarted role) and hands it to every role it starts in `$SAO_POLICY_KEY` (Ray actors too: the
driver's role environment is sent to each actor). docker compose: `sao up --prepare` writes the file into the runs
volume and the roles read it through `$SAO_POLICY_KEY_FILE`, unless `SAO_POLICY_KEY` is set (e.g. in `.env`).
With no key (roles started by hand on one host), announcements go unsigned and a follower takes them all, with a
warning once; a follower that has a key refuses an unsigned announcement as it refuses a wrong signature.

What is signed (`canonical`): the compact ASCII JSON array ["sao-policy/1", topic, v, version, step, uri, sha256,
tensors_sha256, created_at]; the topic ties an announcement to its run, so one replayed from another run fails.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Mapping

import msgspec

from streamer.transport.bus import Consumer, Producer
from streamer.wire.config import ConfigError
from streamer.wire.schema import PolicyVersion
from streamer.wire.settings import warn_once
from streamer.wire.topics import Topics

KEY_ENV = "SAO_POLICY_KEY"
KEY_FILE_ENV = "SAO_POLICY_KEY_FILE"
KEY_FILE = "policy.key"  # in the run directory
MIN_KEY_CHARS = 16
DOMAIN = "sao-policy/1"  # the first element of what is signed: a format change gets a new name


def canonical(pv: PolicyVersion, topic: str) -> bytes:
    """The bytes the HMAC covers: every field of the announcement but `sig`, and the topic it is on."""
    fields = [DOMAIN, topic, int(pv.v), int(pv.version), int(pv.step), pv.uri, pv.sha256, pv.tensors_sha256,
              float(pv.created_at)]  # as a reader decodes them (a struct built in Python may hold an int time)
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode()


def sign(pv: PolicyVersion, topic: str, key: bytes) -> str:
    """The hex HMAC-SHA256 of `pv` on `topic`."""
    return hmac.new(key, canonical(pv, topic), hashlib.sha256).hexdigest()


def signed(pv: PolicyVersion, topic: str, key: bytes | None) -> PolicyVersion:
    """`pv` with its signature (no key: unsigned, as it is)."""
    return pv if key is None else msgspec.structs.replace(pv, sig=sign(pv, topic, key))


def unverified(pv: PolicyVersion, topic: str, key: bytes | None) -> str:
    """Why `pv` must be ignored ("" when it verifies, or when there is no key to verify with)."""
    if key is None:
        return ""
    if not pv.sig:
        return (f"policy v{pv.version}: unsigned announcement, this consumer has the run's key "
                f"(${KEY_ENV}): signature missing, ignored")
    if not hmac.compare_digest(pv.sig.encode(), sign(pv, topic, key).encode()):  # bytes: any text compares
        return (f"policy v{pv.version}: signature does not match (HMAC-SHA256 with the run's key ${KEY_ENV} over "
                f"its fields on {topic}): forged or from another run, ignored")
    return ""


def _checked(key: str, where: str) -> bytes:
    key = key.strip()
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{where}: the policy key has {len(key)} characters; at least {MIN_KEY_CHARS} "
                          f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return key.encode()


def policy_key(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The run's key from the environment ($SAO_POLICY_KEY, else the file $SAO_POLICY_KEY_FILE names); None if
    neither is set. A file named but missing is an error: a role told to verify must not silently stop."""
    if env.get(KEY_ENV, "").strip():
        return _checked(env[KEY_ENV], f"${KEY_ENV}")
    path = env.get(KEY_FILE_ENV, "").strip()
    if not path:
        return None
    try:
        return _checked(Path(path).read_text(), f"${KEY_FILE_ENV} ({path})")
    except OSError as e:
        raise ConfigError(f"${KEY_FILE_ENV}: {path}: {e.strerror}; `sao up --prepare` writes it, or set "
                          f"${KEY_ENV}") from None


def announce(producer: Producer, run: str, pv: PolicyVersion, flush: bool = True, key: bytes | None = None) -> None:
    """Send `pv` to `<run>.policy`, signed with `key` (None: the environment's, `policy_key`; none there: unsigned)."""
    topic = Topics(run).policy
    producer.send(topic, signed(pv, topic, key if key is not None else policy_key()), key="policy")
    if flush:
        producer.flush()


class Announcer:
    """The learner's side of `<run>.policy`: announces each published version at once (signed, sent and flushed).
    The producer stays the caller's (the learner shares it with its events and closes it)."""

    def __init__(self, producer: Producer, run: str, key: bytes | None = None) -> None:
        self.producer, self.run, self.key = producer, run, resolved_key(key, "announcer")

    def __call__(self, pv: PolicyVersion) -> None:
        announce(self.producer, self.run, pv, key=self.key)


def verified(consumer: Consumer, key: bytes | None, timeout: float, max_records: int = 100) -> list[PolicyVersion]:
    """The announcements `consumer` polls that verify with `key`; each other one dead-lettered with the reason."""
    out = []
    for msg, tp, offset in consumer.poll(max_records, timeout):
        why = unverified(msg, tp.topic, key)
        if why:
            consumer.reject(msg, tp, offset, why)
        else:
            out.append(msg)
    return out


def resolved_key(key: bytes | None, role: str) -> bytes | None:
    """`key`, else the environment's (`policy_key`); None, with a warning once, when there is none."""
    key = key if key is not None else policy_key()
    if key is None:
        warn_unsigned(role)
    return key


def warn_unsigned(role: str) -> None:
    """Once per process: policy announcements are not authenticated here."""
    warn_once(f"{role}: policy announcements are NOT authenticated (no ${KEY_ENV} or ${KEY_FILE_ENV}): anyone who "
              "can write to the broker can announce a version; `sao up` sets a key per run")


def run_key(run_dir: str | Path, env: Mapping[str, str] = os.environ) -> str:
    """The run's key for `sao up`: the environment's if it has one (`policy_key`), else `<run_dir>/policy.key`,
    made (mode 0600, 32 random bytes in hex) when missing, so a resumed run and a restarted role keep the key of
    the announcements already on the topic."""
    named = env.get(KEY_FILE_ENV, "").strip()
    if env.get(KEY_ENV, "").strip() or (named and Path(named).is_file()):
        return policy_key(env).decode()
    path = Path(run_dir) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        return _checked(path.read_text(), str(path)).decode()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
        f.flush()
        os.fsync(f.fileno())
    return path.read_text().strip()
