"""The router's config (`router:` in the stack file): on where a model overflows to an economy tier."""

from __future__ import annotations

from typing import Literal, Optional, Sequence

from pydantic import Field, field_validator, model_validator

from components.config_types import Base, Duration, Port, image_unpinned
from components.serving.config import ModelConfig

HAPROXY_IMAGE = "docker.io/library/haproxy:2.6.34@sha256:82c023b4f99e2090b14dbe7f04b0590b4e0af608f7c29cedcabf25c34fb066cd"
"""The official HAProxy image, 2.6 LTS, pinned by its index digest (docker-library/repo-info
repos/haproxy/remote/2.6.34.md at commit 0ed0a0ed: USE_PROMEX=1, USER haproxy (uid 99), STOPSIGNAL
SIGUSR1). The tests run Debian 12's 2.6.12 with the same rendered file; docs/serving.md lists the
features relied on and that both have them."""


class AffinityConfig(Base):
    """Prefix affinity with bounded load for one model (HAProxy `balance hash` with
    `hash-type consistent` and `hash-balance-factor`)."""

    prefix_bytes: int = Field(256, ge=16, le=8192)
    """Hash the first bytes of the request body: requests whose JSON starts the same (same model
    field, same prompt start) go to the same replica, whose prefix cache then holds it."""
    header: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9-]{1,64}$")
    """Hash this request header instead (e.g. a conversation id a client sets)."""
    balance_factor: int = Field(200, ge=101, le=1000)
    """A replica takes at most this % of the average in-flight load; past it the next replica on
    the ring takes the request (HAProxy's bounded-load consistent hashing). HAProxy hands out whole
    slots (2.6 src/lb_chash.c `chash_server_is_eligible`: ceil((in flight + 1) x factor / 100),
    split by weight), so at 150 a router with one request in flight on a replica of two sends the
    next one for the same prefix elsewhere: measured under 4 concurrent clients through two routers,
    the prefix-cache hit rate fell to 50 % (round-robin: 60 %); at 200 it is 85 % (bench/README.md)."""


class RouterConfig(Base):
    enabled: Optional[bool] = None
    """Deploy the router. Unset: on in every cluster where a primary model's `overflow_to` economy
    entry is placed too; `true`: on every cluster that serves a model; `false`: off."""
    image: str = HAPROXY_IMAGE
    """The HAProxy image (2.6 or a later LTS that accepts the same configuration); the controller
    beside it runs the stack's runtime image (runtime/haproxy_ctl.py)."""
    port: Port = 8080
    """The port clients connect to (`http://gpuinfra-router.<ns>.svc:<port>/<model>/v1`)."""
    metrics_port: Port = 9145
    """HAProxy's Prometheus exporter (requests, sessions, queue, retries per backend and server)."""
    controller_port: Port = 9146
    """The controller's /metrics and /ready."""
    max_tries: int = Field(2, ge=1, le=5)
    """Attempts per request within the chosen tier (`retries` = this - 1, each on another replica);
    never after the first byte of a response, never across tiers."""
    agent_interval_ms: int = Field(500, ge=100, le=10000)
    """How often every router asks each replica's sidecar for its load (`agent-inter`): the
    routers agree on a replica's load and drain within this."""
    threads: int = Field(2, ge=1, le=64)
    """HAProxy threads (`nbthread`); also the container's CPU limit in cores, so the threads never
    outnumber the CPU time they may use (HAProxy would otherwise count the node's CPUs)."""
    cpu_millicores: int = Field(500, ge=50, le=64000)
    """HAProxy CPU request."""
    memory_mib: int = Field(256, ge=96, le=16384)
    """HAProxy memory request == limit; `maxconn` and `-m` are derived from it."""
    settle_s: int = Field(5, ge=0, le=60)
    """preStop wait for the router pod's endpoint removal to reach every client before HAProxy
    stops taking connections (a soft stop: open streams finish)."""
    bytes_per_token: int = Field(6, ge=1, le=64)
    """Request-body bytes per prompt token that size HAProxy's buffer: the largest `max_model_len`
    routed x this (plus headers) fits one buffer, so every request the router takes can be retried
    (configuration manual, retry-on: "Requests not fitting in a single buffer will never be
    retried"); a longer body gets 413. English JSON runs ~4 bytes per token, escaped non-ASCII
    (`\\uXXXX`) up to ~6. Memory: three buffers per stream (request, its retry copy, response)."""
    overflow_bytes_per_token: Optional[int] = Field(None, ge=1, le=16)
    """The fewest request-body bytes per prompt token: where an economy entry's `max_model_len`
    is shorter than its primary's, only a request whose body and `max_tokens` fit it at this rate
    overflows; a longer one stays on the primary. 1 is safe for any text (every token is at least
    one byte of the prompt); required when a pair needs the gate."""
    empty_economy: Optional[Literal["retry-after", "queue"]] = None
    """What an overflowing request gets while its economy tier has no replica (an overflow target
    at `min_replicas: 0` waking from zero): `retry-after`, a 503 with `Retry-After:
    retry_after_s` at once; `queue`, a wait for a primary slot in the router's queue (`queue_s`),
    then that 503. Required when an overflow target can be at zero replicas."""
    retry_after_s: int = Field(30, ge=1, le=3600)
    """The `Retry-After` of every 503 the router itself answers."""
    queue_s: int = Field(2, ge=1, le=300)
    """How long a request waits in the router's queue for a free slot (HAProxy `timeout queue`)."""
    affinity: dict[str, AffinityConfig] = {}
    """Per model entry name: route by prompt prefix with bounded load instead of same-node first."""
    overflow_alert_ratio: float = Field(0.25, gt=0, le=1)
    """Alert when more than this share of a primary model's requests goes to its economy tier..."""
    overflow_alert_for: Duration = "15m"
    """...for this long."""

    @field_validator("image")
    @classmethod
    def _image_pinned(cls, v: str) -> str:
        if image_unpinned(v):
            raise ValueError("pin the image to a tag other than 'latest' or to a digest")
        return v

    @model_validator(mode="after")
    def _ports(self):
        if len({self.port, self.metrics_port, self.controller_port}) != 3:
            raise ValueError(
                f"port, metrics_port, controller_port: {self.port}, {self.metrics_port}, {self.controller_port} must differ"
            )
        if self.threads * 1000 < self.cpu_millicores:
            raise ValueError(f"cpu_millicores: {self.cpu_millicores} exceeds threads x 1000 ({self.threads * 1000}), the CPU limit")
        return self


def router_enabled(rc: RouterConfig, models: Sequence[ModelConfig]) -> bool:
    """`models`: the entries placed on one cluster. Auto: a primary there overflows to an entry there."""
    if rc.enabled is not None:
        return rc.enabled and bool(models)
    names = {m.name for m in models}
    return any(m.overflow_to in names for m in models if m.overflow_to)
