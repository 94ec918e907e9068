"""Where Ray placed a run's actors: torchrun's environment per node, what a gang's statuses call for, and the check
that shared paths are shared.

A learner gang's ranks are numbered node by node from where the actors landed (`RoleActor.where`): LOCAL_RANK
0..k-1 and LOCAL_WORLD_SIZE k among the k ranks of a node, the GPUs Ray gave those ranks visible to all of them,
MASTER_ADDR the IP of rank 0's node. Before the run goes on, the hosts of the roles that must share a path write
marker files into it and look for each other's (`streamer.transport.shared`); a path they only read must exist
on each. A run on several hosts without a shared filesystem thus fails at start, naming the setting and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamer.transport import shared
from streamer.wire.config import ConfigError

SHARED_FIX = "put --runs-dir on a filesystem every node mounts at the same path (NFS, a cluster filesystem)"
WEIGHTS_FIX = "use launch.weights_transport=http, or " + SHARED_FIX


def gang_env(places: list[dict[str, Any]], master_addr: str, master_port: int) -> list[dict[str, str]]:
    """torchrun's environment for each actor of a gang, in the order of `places` (actor 0 is rank 0).

    Ranks go node by node (rank 0's node first, then in order of first appearance), so a node's ranks are
    contiguous; GROUP_RANK is the node's index. A node's ranks all see its ranks' GPUs, each rank's first GPU in
    local-rank order (then any others), so `cuda:LOCAL_RANK` is the rank's own GPU."""
    nodes = list(dict.fromkeys(p["node_id"] for p in places))
    order = sorted(range(len(places)), key=lambda i: (nodes.index(places[i]["node_id"]), i))
    out = []
    for i, p in enumerate(places):
        peers = [j for j in order if places[j]["node_id"] == p["node_id"]]
        env = {"RANK": order.index(i), "WORLD_SIZE": len(places), "LOCAL_RANK": peers.index(i),
               "LOCAL_WORLD_SIZE": len(peers), "GROUP_RANK": nodes.index(p["node_id"]),
               "MASTER_ADDR": master_addr, "MASTER_PORT": master_port}
        gpus = [places[j]["gpus"] for j in peers]
        if all(gpus):
            ids = [g[0] for g in gpus] + [x for g in gpus for x in g[1:]]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(ids))
        out.append({k: str(v) for k, v in env.items()})
    return out


def role_verdict(statuses: list[dict[str, Any]], gang: bool, max_restarts: int,
                 gang_restarts: int) -> tuple[str, int | None]:
    """("run" | "done" | "fail" | "restart", returncode) for a role's actor statuses (`RoleActor.status`).

    A rank that failed fast (a bad config, an error at start-up) fails the run, unless a rank of its gang was lost
    (Ray restarted it: idle; or its process was killed by a signal): the peer's death explains the error, however
    soon after the start it came, and all ranks start again."""
    lost = gang and any(s["state"] == "idle" or (s["returncode"] or 0) < 0 for s in statuses)
    fast = [s["returncode"] for s in statuses if s["failed_fast"]]
    if fast and not lost:
        return "fail", fast[0]
    if all(s["state"] == "exited" and s["returncode"] == 0 for s in statuses):
        return "done", 0
    if gang and (lost or any(s["returncode"] not in (None, 0) for s in statuses)):
        if 0 <= max_restarts <= gang_restarts:
            return "fail", next((s["returncode"] for s in statuses if s["returncode"]), 1)
        return "restart", None
    return "run", None


def host_label(place: dict[str, Any]) -> str:
    return f"{place['host']} ({place['ip']}, node {place['node_id'][:8]})"


@dataclass(frozen=True)
class Need:
    """A path that the hosts of some roles must share (`writes`: they write into it and read each other's files)
    or that each of them reads (it must exist on every one)."""

    setting: str
    path: str
    roles: tuple[str, ...]  # role names; "agent" stands for agent-0, agent-1, ...
    writes: bool = True
    fix: str = SHARED_FIX

    def covers(self, role_name: str) -> bool:
        return any(role_name == r or role_name.startswith(r + "-") for r in self.roles)


def run_needs(cfg) -> list[Need]:
    """What a `sao up` run on Ray needs shared (`cfg`: a `streamer.launch.run_config.RunConfig`). The run's
    config.yaml travels by value (`RoleActor` writes it on each node); agents that start from the weight server
    (`agent.model` http://...) read no model directory; one learner rank checks its checkpoint directory alone."""
    both = ("learner", "agent")
    needs = [Need("learner.io.init", cfg.learner.io.init, ("learner",), writes=False),
             Need("learner.checkpoint.dir", cfg.learner.checkpoint.dir, ("learner",))]
    if not cfg.agent.model_is_url():  # (else pulled from the learner's weight server)
        needs.append(Need("agent.model", cfg.agent.model, ("agent",), writes=False))
    if cfg.launch.weights_transport == "directory":
        needs.append(Need("learner.io.weights_dir (agent.weights_dir)", cfg.learner.io.weights_dir, both,
                          fix=WEIGHTS_FIX))
    return [n for n in needs if n.path]


def learner_on_driver(ray_cfg, weights_transport: str) -> bool:
    """Pin one learner rank to the driver's node (`ray.learner_node`; auto: when versions travel over the network,
    so the warm start is read, and the weight server advertised, there). A gang goes where its placement group is."""
    node = ray_cfg.learner_node
    return ray_cfg.learner_workers == 1 and (node == "driver" or (node == "auto" and weights_transport != "directory"))


def driver_ip() -> str:
    """The IP of the Ray node this driver runs on (as Ray knows it: what actors there report as theirs)."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == me), ray.util.get_node_ip_address())


def check_paths(needs: list[Need], actors_by_role: dict[str, list], timeout: float = 120.0) -> None:
    """ConfigError unless, for each need, the nodes of its roles' actors see the same directory at its path.
    `actors_by_role`: role name -> its `RoleActor` handles (one probe per node runs on one of them)."""
    import ray

    places: dict[str, tuple[dict[str, Any], Any]] = {}  # actor key -> (where, handle)
    handles = [(name, i, a) for name, actors in actors_by_role.items() for i, a in enumerate(actors)]
    for (name, i, a), where in zip(handles, ray.get([a.where.remote() for _, _, a in handles], timeout=timeout)):
        places[f"{name}/{i}"] = (where, a)
    errors = []
    for need in needs:
        hosts: dict[str, Any] = {}
        for key, (where, handle) in places.items():
            if need.covers(key.rpartition("/")[0]):
                hosts.setdefault(host_label(where), handle)
        if not hosts:
            continue

        def call_all(op: str, args: dict[str, tuple], hosts=hosts) -> dict[str, Any]:
            keys = list(args)
            return dict(zip(keys, ray.get([hosts[k].probe.remote(op, *args[k]) for k in keys], timeout=timeout)))
        error = shared.check(need.setting, need.path, need.fix, list(hosts), call_all, writes=need.writes)
        if error:
            errors.append(error)
    if errors:
        raise ConfigError("\n".join(errors))
