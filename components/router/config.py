"""The router's config (`router:` in the stack file): on where a model overflows to an economy tier."""

from __future__ import annotations

from typing import Optional, Sequence

from pydantic import Field, field_validator, model_validator

from components.config_types import Base, Duration, Port, image_unpinned
from components.serving.config import ModelConfig

NGINX_IMAGE = "docker.io/library/nginx:1.28.0@sha256:eaa7e36decc3421fc04478c586dfea0d931cebe47d5bc0b15d758a32ba51126f"
"""The official nginx image, pinned by digest (1.28.0 is the stable line's tag that
nginx/docker-nginx's `stable/` Dockerfiles build from; docs/serving.md; the digest is the one
pulumi-docker's `RemoteImage` docs give for that tag). Its Dockerfile sets STOPSIGNAL SIGQUIT."""


class RouterConfig(Base):
    enabled: Optional[bool] = None
    """Deploy the router. Unset: on in every cluster where a primary model's `overflow_to` economy
    entry is placed too; `true`: on every cluster that serves a model; `false`: off."""
    image: str = NGINX_IMAGE
    """The nginx image (the endpoint watcher beside it runs the stack's runtime image)."""
    port: Port = 8080
    """The port clients connect to (`http://gpuinfra-router.<ns>.svc:<port>/<model>/v1`)."""
    metrics_port: Port = 9145
    """The watcher's /metrics and /ready."""
    log_port: Port = 9514
    """Loopback UDP port nginx sends its JSON access log to (syslog); the watcher counts it."""
    max_tries: int = Field(2, ge=1, le=5)
    """Upstream attempts per tier (`proxy_next_upstream_tries`): at most this many primary replicas,
    then at most this many economy replicas; never after the first byte of a response."""
    keepalive: int = Field(16, ge=0, le=1024)
    """Idle keep-alive connections per upstream per worker (0: a new connection per request)."""
    settle_s: int = Field(5, ge=0, le=60)
    """preStop wait for the router pod's endpoint removal to reach every client before nginx stops
    taking connections."""
    cpu_millicores: int = Field(500, ge=50, le=16000)
    """nginx CPU request (no CPU limit: throttling would add latency to every token)."""
    memory_mib: int = Field(256, ge=64, le=16384)
    """nginx memory request == limit."""
    overflow_alert_ratio: float = Field(0.25, gt=0, le=1)
    """Alert when more than this share of a model's requests is served by its economy tier..."""
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
        if len({self.port, self.metrics_port, self.log_port}) != 3:
            raise ValueError(
                f"port, metrics_port, log_port: {self.port}, {self.metrics_port}, {self.log_port} must differ"
            )
        return self


def router_enabled(rc: RouterConfig, models: Sequence[ModelConfig]) -> bool:
    """`models`: the entries placed on one cluster. Auto: a primary there overflows to an entry there."""
    if rc.enabled is not None:
        return rc.enabled and bool(models)
    names = {m.name for m in models}
    return any(m.overflow_to in names for m in models if m.overflow_to)
