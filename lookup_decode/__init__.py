"""lookup_decode: faster generation without a draft model, by drafting from text already in context.

    out = model.generate(**inputs, custom_generate=lookup_decode.generate)

Greedy output is token-for-token identical to plain `model.generate`; sampling keeps the model's
own distribution (lossless speculative sampling).
"""

from lookup_decode.cache import UnsupportedCacheError
from lookup_decode.config import LookupConfig
from lookup_decode.corpus import CorpusFileError
from lookup_decode.cost import COSTS, CostCurve, CostModel
from lookup_decode.decode import Rows, decode, step
from lookup_decode.draft import Draft, Drafter
from lookup_decode.draft_model import DraftModelProposer
from lookup_decode.hf import generate, lookup_decoding
from lookup_decode.index import SuffixIndex
from lookup_decode.memory import Memory, References
from lookup_decode.models import ModelNotFoundError, load_model
from lookup_decode.policy import DraftPolicy
from lookup_decode.stats import DecodeStats
from lookup_decode.stopping import StopStrings
from lookup_decode.tree import TreeProposer

__all__ = ["generate", "lookup_decoding", "decode", "step", "Rows", "Draft", "Drafter", "SuffixIndex", "TreeProposer",
           "DraftModelProposer", "DecodeStats", "LookupConfig", "DraftPolicy", "CostCurve", "CostModel", "COSTS",
           "StopStrings", "UnsupportedCacheError", "load_model", "ModelNotFoundError", "Memory", "References",
           "CorpusFileError"]
__version__ = "0.1.0"
