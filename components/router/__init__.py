"""Router: one nginx per GPU node in front of the model replicas (primary -> economy overflow,
same-node replicas first, safe through drains). `config.py` is its config; `nginx_conf.py` renders
nginx.conf and `specs.py` the Kubernetes objects (pure deciders); `monitoring.py` the alert and the
dashboard row; `router.py` is the `Router` component; `runtime/watcher.py` (top level) is the stdlib endpoint
watcher the pod runs (EndpointSlices -> upstream blocks -> graceful reload, access log -> metrics)."""
