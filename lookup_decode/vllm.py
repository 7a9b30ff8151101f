"""The documented path of the vLLM drafter (`speculative_config={"method": "custom_class", "model":
"lookup_decode.vllm.LookupDrafter", ...}`); it lives in `lookup_decode.engines.vllm`."""

from lookup_decode.engines.vllm.drafter import *  # noqa: F401,F403
from lookup_decode.engines.vllm.drafter import LookupDrafter, Settings  # noqa: F401
