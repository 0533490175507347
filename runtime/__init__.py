"""Code that runs inside the stack's pods (never inside `pulumi up`): the vLLM drain sidecar and preStop
client (`drain.py`, `disruption.py`, `deadline_http.py`) with the HAProxy agent-check responder
(`agent_check.py`), the weight pre-warm init container (`prewarm.py`) and the router's controller
(`haproxy_ctl.py`, `haproxy_api.py`). It is one image's worth of code, kept apart from `components/`,
which only renders the pods that run it."""
