"""A `vllm.general_plugins` entry point: vLLM calls `register()` once in each of its processes.

vLLM copies to Ray workers only the environment variables it knows or whose prefix is listed in
VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY (vllm/ray/ray_env.py), so the drafter's LOOKUP_DECODE_* settings would
not reach a worker on another node. Adding the prefix in the process that starts the workers fixes that; it is
all this does (nothing else of lookup_decode is imported, and a process without LOOKUP_DECODE_* settings is
left as it was).
"""

import os

PREFIX = "LOOKUP_DECODE_"
VARIABLE = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def register() -> None:
    if not any(name.startswith(PREFIX) for name in os.environ):
        return
    prefixes = [p for p in os.environ.get(VARIABLE, "").split(",") if p]
    if PREFIX not in prefixes:
        os.environ[VARIABLE] = ",".join(prefixes + [PREFIX])
