"""lookup_decode: faster generation without a draft model, by drafting from text already in context.

    out = model.generate(**inputs, custom_generate=lookup_decode.generate)

Greedy output is token-for-token identical to plain `model.generate`; sampling keeps the model's
own distribution (lossless speculative sampling).
"""

from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import COSTS, CostCurve, CostModel
from lookup_decode.core.decode import Rows, decode, step
from lookup_decode.core.draft import Draft, Drafter
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.stats import DecodeStats
from lookup_decode.engines.hf.cache import UnsupportedCacheError
from lookup_decode.engines.hf.draft_model import DraftModelProposer
from lookup_decode.engines.hf.hook import generate, lookup_decoding
from lookup_decode.engines.hf.models import ModelNotFoundError, code_model, load_model
from lookup_decode.engines.hf.stopping import StopStrings
from lookup_decode.sources.corpus import CorpusFileError
from lookup_decode.sources.memory import Memory, References
from lookup_decode.sources.tree import TreeProposer

__all__ = ["generate", "lookup_decoding", "decode", "step", "Rows", "Draft", "Drafter", "SuffixIndex", "TreeProposer",
           "DraftModelProposer", "DecodeStats", "LookupConfig", "DraftPolicy", "CostCurve", "CostModel", "COSTS",
           "StopStrings", "UnsupportedCacheError", "load_model", "code_model", "ModelNotFoundError", "Memory",
           "References", "CorpusFileError"]
__version__ = "0.1.0"

# Last, once the imports above have loaded numba: without it vLLM's CPU build cannot start an engine in this process,
# and a script that imported lookup_decode may build one with vLLM's own `LLM`, where no code of ours runs later.
from lookup_decode.engines.vllm.kernel_scan import survive_kernel_scan  # noqa: E402

survive_kernel_scan()
