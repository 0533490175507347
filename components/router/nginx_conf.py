"""The router's nginx.conf: one `location /<model>/` per routed model, primary then economy.

Pure: a `NginxSettings` and the routes in, the config text out. The upstream blocks it includes
are written at run time by the endpoint watcher (runtime/watcher.py) from the EndpointSlices.
Every directive is in nginx's reference (nginx.org/en/docs, checked for 1.22.1, the Debian 12 build
the tests run, and 1.28, the pinned image); docs/serving.md lists each with its page. The tests
start the real nginx with this text (`nginx -t` and live traffic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

RETRY_CONDITIONS = ("error", "http_429", "http_500", "http_502", "http_503", "http_504", "non_idempotent")
"""`proxy_next_upstream`: connection errors and the statuses a replica answers before any byte
(vLLM's 500 after SIGTERM; 502-504 from a dying pod). `non_idempotent` because completions are
POSTs. No `timeout`: a slow prefill is never sent twice. nginx retries only while nothing has been
sent to the client, so a stream that started is never replayed (ngx_http_proxy_module)."""
FALLBACK_STATUSES = (429, 500, 502, 503, 504)
"""Statuses the primary tier ends with that hand the request to the economy tier (error_page)."""
LOG_FORMAT = "gpuinfra_router"


@dataclass(frozen=True)
class Route:
    model: str
    """The path prefix, `/<model>/` (the model's config name)."""
    primary: str
    """The upstream of the entry's own replicas."""
    economy: Optional[str] = None
    """The upstream that takes the overflow, if any."""
    tier: str = "primary"
    """The tier of `primary` (an economy entry's own route serves economy replicas)."""


@dataclass(frozen=True)
class NginxSettings:
    port: int
    upstreams_path: str
    pid_path: str
    temp_dir: str
    log_port: int
    worker_shutdown_timeout_s: int
    read_timeout_s: int
    max_tries: int
    connect_timeout_s: int = 2
    listen_addr: str = ""
    worker_processes: str = "auto"
    error_log: str = "stderr warn"


def location(r: Route, s: NginxSettings) -> str:
    prefix = f"/{r.model}/"
    lines = [
        f"        location {prefix} {{",
        f"            set $router_model {r.model};",
        f"            set $router_tier {r.tier};",
        f"            rewrite ^/{r.model}(/.*)$ $1 break;",
        f"            proxy_pass http://{r.primary};",
    ]
    if r.economy:
        # nginx's own 502 (every replica at max_conns, or all failed) and the replicas' last error
        # both go to the economy tier; a named location keeps the method and the buffered body.
        lines += [
            "            proxy_intercept_errors on;",
            f"            error_page {' '.join(map(str, FALLBACK_STATUSES))} = @{r.model}-economy;",
        ]
    lines.append("        }")
    if r.economy:
        lines += [
            f"        location @{r.model}-economy {{",
            f"            set $router_model {r.model};",
            "            set $router_tier economy;",
            f"            proxy_pass http://{r.economy};",
            "        }",
        ]
    return "\n".join(lines)


def render_nginx_conf(routes: list[Route], s: NginxSettings) -> str:
    listen = f"{s.listen_addr}:{s.port}" if s.listen_addr else str(s.port)
    t = s.temp_dir
    log_fields = (
        '{"model":"$router_model","tier":"$router_tier","status":"$status",'
        '"upstream_status":"$upstream_status","upstream_addr":"$upstream_addr",'
        '"request_time":"$request_time","upstream_header_time":"$upstream_header_time"}'
    )
    body = "\n".join(location(r, s) for r in routes)
    return f"""# Rendered by components/router/nginx_conf.py; upstreams by runtime/watcher.py.
worker_processes {s.worker_processes};
worker_shutdown_timeout {s.worker_shutdown_timeout_s}s;
pid {s.pid_path};
error_log {s.error_log};
daemon off;

events {{
    worker_connections 4096;
}}

http {{
    client_body_temp_path {t}/body;
    proxy_temp_path {t}/proxy;
    fastcgi_temp_path {t}/fastcgi;
    uwsgi_temp_path {t}/uwsgi;
    scgi_temp_path {t}/scgi;
    client_max_body_size 16m;
    client_body_buffer_size 1m;
    server_tokens off;

    log_format {LOG_FORMAT} escape=json '{log_fields}';
    access_log syslog:server=127.0.0.1:{s.log_port},tag=router,nohostname {LOG_FORMAT};

    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_set_header Host $host;
    proxy_buffering off;
    proxy_request_buffering on;
    proxy_connect_timeout {s.connect_timeout_s}s;
    proxy_send_timeout {s.read_timeout_s}s;
    proxy_read_timeout {s.read_timeout_s}s;
    proxy_next_upstream {' '.join(RETRY_CONDITIONS)};
    proxy_next_upstream_tries {s.max_tries};

    include {s.upstreams_path};

    server {{
        listen {listen};
        set $router_model "-";
        set $router_tier "-";

        location = /healthz {{
            access_log off;
            return 200 "ok\\n";
        }}
{body}
        location / {{
            return 404 "no such model; use /<model>/v1/...\\n";
        }}
    }}
}}
"""
