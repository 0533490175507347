"""Serving: one vLLM stack per model and cluster. `config.py` is the model's config (engine flags,
resources, cache, drain, autoscaling, placements); `vllm_args.py`, `pod_spec.py`, `objects.py`,
`autoscale.py`, `alerts.py` and `dashboard.py` are the pure deciders; `vllm_serving.py` is the
`VllmServing` component. The code the pods run (the drain sidecar and preStop hook, the weight
pre-warmer) lives in the top-level `runtime/` folder, apart from the code `pulumi up` runs."""
