"""The documented paths of the vLLM drafter (`speculative_config={"method": "custom_class", "model":
"lookup_decode.vllm.LookupDrafter", ...}`) and of the OpenAI server's Predicted Outputs middleware
(`--middleware lookup_decode.vllm.PredictedOutputs`); they live in `lookup_decode.engines.vllm`."""

from lookup_decode.engines.vllm.drafter import *  # noqa: F401,F403
from lookup_decode.engines.vllm.drafter import LookupDrafter, Settings  # noqa: F401
from lookup_decode.engines.vllm.predicted_outputs import PredictedOutputs  # noqa: F401
