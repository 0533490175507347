"""Code that runs inside the stack's pods (never inside `pulumi up`): the vLLM drain sidecar and preStop
client (`drain.py`, `disruption.py`, `deadline_http.py`), the weight pre-warm init container
(`prewarm.py`) and the router's endpoint watcher (`watcher.py`). It is one image's worth of code, kept
apart from `components/`, which only renders the pods that run it."""
