"""HAProxy's runtime API, as the router's controller uses it: the servers a backend should have
(from EndpointSlices), the servers it has (`show servers state`, `show stat`), and the commands
that move one to the other without cutting a stream.

Lifecycle of one server (management guide 2.6, "add server", "del server"):
  add server <be>/<pod> <addr>:<port> id <id> weight 100 maxconn <share> agent-check
      agent-send share=<slot>/<count>. check port <agent port> ...
  [set weight <be>/<pod> 0]              (this router's share of the replica is 0 slots)
  enable health, enable agent, enable server   (a dynamic server starts in MAINT)
  ... the routers come and go: set server <be>/<pod> agent-send ..., set maxconn server ...
  ... the pod leaves the EndpointSlice (or turns not ready / terminating) ...
  set server <be>/<pod> state drain     (no new requests; open streams continue)
  ... 0 current sessions (or the longest request's timeout) ...
  disable agent                          (so a late agent reply cannot act on it)
  set server <be>/<pod> state maint
  del server <be>/<pod>                  (refused while idle pooled connections remain: retried)
"""

from __future__ import annotations

import dataclasses
import re
import socket
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""The label the EndpointSlice controller sets on every slice of a Service (discovery.k8s.io/v1)."""
WEIGHT = 100
"""Every server's configured weight: an agent's `n%` then means weight n (with weight 1, 50 % is 0)."""
ID_SPACE = 1 << 29
REMOTE_BASE = ID_SPACE
"""`balance first` takes the lowest id with a free slot: this node's replicas get ids below
REMOTE_BASE, the others above it. Ids must be positive 31-bit integers."""
ADMF_MAINT = 0x01 | 0x02 | 0x04 | 0x20 | 0x40
ADMF_DRAIN = 0x08 | 0x10
"""`srv_admin_state` bits (include/haproxy/server-t.h, 2.6): forced/inherited/config/resolution/
health maintenance, forced/inherited drain."""
HEALTH_INTER_MS = 400
HEALTH_FALL = 2
"""The health check asks the replica's sidecar (its agent port) every 400 ms; two failures in a
row (refused, or no `up`/`drain` line within `timeout check`, haproxy_cfg.CHECK_TIMEOUT_MS) mark
the server DOWN: a dead, hung or too slow sidecar is out within 2 x (400 + 400) ms = 1.6 s. An
agent that cannot be reached changes nothing by itself (configuration manual, "agent-check":
"Failure to connect to the agent is not considered an error")."""
SYNCED_KEY = "_synced"
"""The capacity map's sentinel (not a model name: those are DNS labels): 0 in the file HAProxy
loads at start, 1 once the controller has synced this HAProxy process. HAProxy's own readiness
(`monitor fail`, haproxy_cfg) and the controller's /ready read it, so a restarted HAProxy, whose
servers and capacities are gone, is not Ready until they are back."""


@dataclass(frozen=True)
class BackendSpec:
    name: str
    service: str
    port_name: str
    agent_port: int
    maxconn: int
    local_first: bool
    """`balance first` backends: this node's replicas first. Otherwise (hash) one id per pod on
    every router."""
    capacity: bool = False
    """A route's own backend: the controller keeps its capacity in the frontend's map."""


@dataclass(frozen=True)
class Share:
    """One (router, backend) pair's place among all the pairs that send to a Service's replicas:
    every router (R) times every backend fed by that Service on each router (B). The agent's
    `maxconn:` is `split(slots, share)` (runtime/agent_check.py), which sums to the slots."""

    slot: int = 0
    count: int = 1

    def token(self) -> str:
        """The `agent-send` string: one runtime-API argument (no space, no ';', no newline)."""
        return f"share={self.slot}/{self.count}."

    def slots(self, capacity: int) -> int:
        """The same split as the agent's (agent_check.split)."""
        return capacity // self.count + (1 if self.slot < capacity % self.count else 0)


def routers_of(slices: Iterable[dict[str, Any]], service: Optional[str]) -> list[str]:
    """Every router pod in the router Service's EndpointSlices, ready or not, terminating or not:
    a router counts from the moment its pod has an address (before it can be Ready) until its pod
    is gone (while it still finishes streams), so a share is lowered before a new router takes
    requests and raised only after a departed one has stopped."""
    names = set()
    for s in slices:
        if service is None or ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) != service:
            continue
        for ep in s.get("endpoints") or []:
            ref = ep.get("targetRef") or {}
            for addr in (ep.get("addresses") or [])[:1]:
                names.add(ref.get("name") or addr)
    return sorted(names)


def shares(backends: list[BackendSpec], routers: list[str], me: str) -> dict[str, Share]:
    """This router's base place for each backend: routers sorted by pod name (this one counted
    even before its own endpoint is listed), then the backends a Service feeds, by name."""
    everyone = sorted(set(routers) | {me})
    i = everyone.index(me)
    out = {}
    for b in backends:
        fed = sorted(x.name for x in backends if x.service == b.service)
        out[b.name] = Share(i * len(fed) + fed.index(b.name), len(everyone) * len(fed))
    return out


def server_share(base: Share, server: str) -> Share:
    """Rotated by the server's name, the same on every router: a bijection of the places, so the
    shares still add up, while the remainder slots fall to different routers for different replicas."""
    return Share((base.slot + stable_id(server)) % base.count, base.count)


@dataclass(frozen=True, order=True)
class Endpoint:
    pod: str
    uid: str
    address: str
    port: int
    node: str


@dataclass(frozen=True)
class Want:
    name: str
    id: int
    address: str
    port: int
    local: bool


@dataclass(frozen=True)
class Have:
    name: str
    id: int
    address: str
    port: int
    admin: int
    weight: int
    sessions: int = 0
    limit: int = 0
    """The server's current maxconn (the agent's `maxconn:` replaces the configured one)."""

    @property
    def usable(self) -> bool:
        return self.weight > 0 and not self.admin & (ADMF_MAINT | ADMF_DRAIN)


def usable_endpoint(ep: dict[str, Any]) -> bool:
    """Ready and not terminating; an unset condition reads as ready / not terminating
    (EndpointConditions, discovery.k8s.io/v1)."""
    cond = ep.get("conditions") or {}
    return cond.get("ready") is not False and cond.get("terminating") is not True


def server_name(pod: str) -> str:
    """Server names allow letters, digits, '-', '_', '.' and ':'; pod names and IPs fit."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", pod)[:100]


def endpoints_of(slices: Iterable[dict[str, Any]], service: str, port_name: str) -> list[Endpoint]:
    found: dict[str, Endpoint] = {}
    for s in slices:
        if ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) != service:
            continue
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name") == port_name), None)
        if port is None:
            continue
        for ep in s.get("endpoints") or []:
            if not usable_endpoint(ep):
                continue
            ref = ep.get("targetRef") or {}
            for addr in (ep.get("addresses") or [])[:1]:  # one address per endpoint (the API's rule)
                pod = ref.get("name") or addr
                found[pod] = Endpoint(pod, ref.get("uid") or pod, addr, int(port), ep.get("nodeName") or "")
    return sorted(found.values())


def stable_id(key: str) -> int:
    return zlib.crc32(key.encode()) % (ID_SPACE - 1) + 1


def wanted(b: BackendSpec, endpoints: list[Endpoint], node: str) -> dict[str, Want]:
    """The servers `b` should hold on the router of `node`. Hash backends: id from the pod's uid
    alone (the same on every router, so the consistent ring matches). `first` backends: this
    node's replicas below REMOTE_BASE, the rest above, the remote order salted by this node so
    the routers of different nodes do not all fill the same remote replica first."""
    out: dict[str, Want] = {}
    used: set[int] = set()
    for e in endpoints:
        local = e.node == node
        if b.local_first:
            sid = stable_id(e.uid) if local else REMOTE_BASE + stable_id(f"{node}/{e.uid}")
        else:
            sid = stable_id(e.uid)
        while sid in used:  # a crc32 collision: the next free id (deterministic for a given set)
            sid += 1
        used.add(sid)
        name = server_name(e.pod)
        out[name] = Want(name, sid, e.address, e.port, local)
    return out


# ---- the runtime API ------------------------------------------------------------------------------


class ApiError(RuntimeError):
    pass


class RuntimeApi:
    """One command per connection on the stats socket (a unix path, or host:port for tests)."""

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address, self.timeout_s = address, timeout_s

    def __call__(self, command: str) -> str:
        if self.address.startswith("/"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = self.address
        else:
            host, port = self.address.rsplit(":", 1)
            sock, target = socket.socket(socket.AF_INET, socket.SOCK_STREAM), (host, int(port))
        with sock:
            sock.settimeout(self.timeout_s)
            sock.connect(target)
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while True:
                b = sock.recv(65536)
                if not b:
                    break
                chunks.append(b)
        return b"".join(chunks).decode("utf-8", "replace")


def parse_servers_state(text: str) -> dict[str, dict[str, Any]]:
    """`show servers state <backend>`: version line, a `#` header, one line per server."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln[1:].split() for ln in lines if ln.startswith("#")), None)
    if header is None:
        return {}
    out = {}
    for ln in lines:
        if ln.startswith("#") or len(ln.split()) < len(header):
            continue
        row = dict(zip(header, ln.split()))
        out[row["srv_name"]] = row
    return out


def parse_stat_sessions(text: str, backend: str) -> dict[str, tuple[int, int]]:
    """`show stat` CSV: (current sessions `scur`, session limit `slim`) per server of `backend`."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    cols = lines[0][2:].split(",")
    out = {}
    for ln in lines[1:]:
        row = dict(zip(cols, ln.split(",")))
        if row.get("pxname") == backend and row.get("svname") not in ("FRONTEND", "BACKEND", None):
            out[row["svname"]] = (int(row.get("scur") or 0), int(row.get("slim") or 0))
    return out


def have(api: RuntimeApi, backend: str) -> dict[str, Have]:
    state = parse_servers_state(api(f"show servers state {backend}"))
    sessions = parse_stat_sessions(api("show stat"), backend)
    return {
        name: Have(name, int(r["srv_id"]), r["srv_addr"], int(r["srv_port"]), int(r["srv_admin_state"]),
                   int(r["srv_uweight"]), *sessions.get(name, (0, 0)))
        for name, r in state.items()
    }


def add_command(b: BackendSpec, w: Want, agent_inter_ms: int, share: Share = Share()) -> str:
    """`maxconn` is this router's share (at least 1: 0 is unlimited), before the agent's first reply."""
    host = f"[{w.address}]" if ":" in w.address else w.address
    return (f"add server {b.name}/{w.name} {host}:{w.port} id {w.id} weight {WEIGHT} "
            f"maxconn {max(1, share.slots(b.maxconn))} check port {b.agent_port} inter {HEALTH_INTER_MS}ms "
            f"fall {HEALTH_FALL} rise 1 agent-check agent-port {b.agent_port} agent-inter {agent_inter_ms}ms "
            f"agent-send {share.token()} pool-purge-delay 1s")


def apply_share(api: RuntimeApi, b: BackendSpec, name: str, share: Share) -> None:
    """A new share at once (the agent's next reply confirms it): the lower limit, and weight 0 for
    a share of no slots. A share that grows back leaves the weight to the agent's next reply."""
    api(f"set server {b.name}/{name} agent-send {share.token()}")
    api(f"set maxconn server {b.name}/{name} {max(1, share.slots(b.maxconn))}")
    if share.slots(b.maxconn) == 0:
        api(f"set weight {b.name}/{name} 0")


@dataclass
class Step:
    """What one reconcile did, for the metrics and the tests."""
    added: list[str]
    drained: list[str]
    deleted: list[str]
    restored: list[str]
    capacity: int = 0


def check(out: str, command: str, ok: tuple[str, ...] = ("",)) -> str:
    text = out.strip()
    if text and not any(text.startswith(o) for o in ok if o):
        raise ApiError(f"{command!r}: {text}")
    return text


def reconcile(api: RuntimeApi, b: BackendSpec, want: dict[str, Want], removing: dict[str, float], now: float,
              removal_timeout_s: float, agent_inter_ms: int, caps_map: Optional[str] = None,
              base: Share = Share(), sent: Optional[dict[str, Share]] = None) -> Step:
    """One pass: add what is missing, drain what left, delete what drained. `removing` (name ->
    drain start) is the caller's memory of the servers this controller put in DRAIN, so a drain
    the agent set (the pod's own) is never undone and a returning endpoint is restored. `base` is
    this router's place for `b` (`shares`); `sent` (name -> share) the caller's memory of what each
    server was last given, so a change of routers reaches every server once (None: shares are set
    only when a server is added)."""
    cur = have(api, b.name)
    step = Step([], [], [], [])
    track = sent is not None
    sent = {} if sent is None else sent
    taken = {h.id for h in cur.values()}
    for name, w in want.items():
        h = cur.get(name)
        share = server_share(base, name)
        if h is None:
            while w.id in taken:  # a departing server still holds this id (a crc32 collision)
                w = dataclasses.replace(w, id=w.id + 1)
            taken.add(w.id)
            check(api(add_command(b, w, agent_inter_ms, share)), "add server", ("New server registered",))
            if share.slots(b.maxconn) == 0:
                api(f"set weight {b.name}/{name} 0")
            sent[name] = share
            api(f"enable health {b.name}/{name}")
            api(f"enable agent {b.name}/{name}")
            api(f"enable server {b.name}/{name}")
            step.added.append(name)
        elif name in removing:
            api(f"enable agent {b.name}/{name}")
            api(f"set server {b.name}/{name} state ready")
            removing.pop(name)
            step.restored.append(name)
        elif (h.address, h.port) != (w.address, w.port):
            api(f"set server {b.name}/{name} addr {w.address} port {w.port}")
        if track and h is not None and sent.get(name) != share:
            apply_share(api, b, name, share)
            sent[name] = share
    for name in [n for n in sent if n not in want]:
        sent.pop(name)  # leaving: its share no longer matters (it takes nothing new)
    for name, h in cur.items():
        if name in want:
            continue
        if name not in removing:
            api(f"set server {b.name}/{name} state drain")
            removing[name] = now
            step.drained.append(name)
            continue
        if h.sessions > 0 and now - removing[name] < removal_timeout_s:
            continue
        api(f"disable agent {b.name}/{name}")
        api(f"set server {b.name}/{name} state maint")
        if h.sessions > 0:
            api(f"shutdown sessions server {b.name}/{name}")
        out = api(f"del server {b.name}/{name}").strip()
        if out.startswith("Server deleted"):
            removing.pop(name)
            step.deleted.append(name)
    for name in [n for n in removing if n not in cur]:
        removing.pop(name)  # gone already (HAProxy restarted)
    after = have(api, b.name) if (step.added or step.restored) else cur
    # The map is compared with be_conn, which also counts the streams on servers that take nothing
    # new (saturated, draining, leaving): their current sessions are part of the capacity.
    step.capacity = sum((h.limit or b.maxconn) if (n in want and n not in removing and h.usable) else h.sessions
                        for n, h in after.items())
    if caps_map and b.capacity:
        api(f"set map {caps_map} {b.name} {step.capacity}")
    return step


def synced(api: RuntimeApi, caps_map: str) -> bool:
    """Whether this HAProxy process has been synced (SYNCED_KEY is 1): `get map` answers
    `... key="_synced", value="1" ...` (management guide 2.6, "get map")."""
    return 'value="1"' in api(f"get map {caps_map} {SYNCED_KEY}")


def mark_synced(api: RuntimeApi, caps_map: str) -> None:
    check(api(f"set map {caps_map} {SYNCED_KEY} 1"), "set map")
