"""Router: one HAProxy per GPU node in front of the model replicas (same node -> other nodes ->
economy overflow, by the replicas' own load report; optional prefix affinity). `config.py` is its
config; `haproxy_cfg.py` renders haproxy.cfg and `specs.py` the Kubernetes objects (pure deciders);
`monitoring.py` the alerts and the dashboard row; `router.py` is the `Router` component. The pod's
controller is runtime/haproxy_ctl.py (EndpointSlices -> runtime API), and each replica's drain
sidecar answers the agent check (runtime/agent_check.py)."""
