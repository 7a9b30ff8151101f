"""lookup_decode: faster generation without a draft model, by drafting from text already in context.

    out = model.generate(**inputs, custom_generate=lookup_decode.generate)

Greedy output is token-for-token identical to plain `model.generate`; sampling keeps the model's
own distribution (lossless speculative sampling).
"""

from lookup_decode.cache import UnsupportedCacheError
from lookup_decode.config import LookupConfig
from lookup_decode.decode import lookup_generate
from lookup_decode.draft_model import DraftModelProposer
from lookup_decode.hf import generate, lookup_decoding
from lookup_decode.index import SuffixIndex
from lookup_decode.corpus import CorpusFileError
from lookup_decode.memory import Memory, References
from lookup_decode.models import ModelNotFoundError, load_model
from lookup_decode.policy import CostCurve, DraftPolicy
from lookup_decode.stats import DecodeStats
from lookup_decode.stopping import StopStrings

__all__ = ["generate", "lookup_decoding", "lookup_generate", "SuffixIndex", "DraftModelProposer", "DecodeStats", "LookupConfig",
           "DraftPolicy", "CostCurve", "StopStrings", "UnsupportedCacheError", "load_model", "ModelNotFoundError",
           "Memory", "References", "CorpusFileError"]
__version__ = "0.1.0"
