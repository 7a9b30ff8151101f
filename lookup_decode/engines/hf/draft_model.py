"""DraftModelProposer: drafts from a small Transformers model that shares the target's tokenizer.

Unlike the suffix index, whose drafts are point masses, a sampling draft model draws its drafts from
its own distribution q and returns q with them (`Draft.probs`), so the verifier applies the general
speculative-sampling rule (accept with min(1, p/q), on rejection draw from max(0, p - q)); see
`verify.accept_with_draft_probs`. Argmax drafts (do_sample=False) are point masses like the index's.
Its KV cache only ever holds accepted tokens: drafted tokens are cropped right after proposing.
"""

from __future__ import annotations

import numpy as np
import torch

from lookup_decode.core.draft import Draft
from lookup_decode.core.tokens import as_token_array
from lookup_decode.engines.hf.cache import (
    RECORDS_RECURRENT,
    UnsupportedCacheError,
    cache_argument,
    check_croppable,
    crop,
    has_recurrent_state,
    new_cache,
)
from lookup_decode.engines.hf.forward import vocab_size


class DraftModelProposer:
    """Propose up to `max_tokens` tokens by running `draft_model` autoregressively.

    Args:
        draft_model: a causal LM whose vocabulary matches the target's (same tokenizer).
        do_sample: sample drafts from q = softmax(logits / temperature) (use with do_sample=True on
            the target); False drafts the argmax (for greedy targets).
        temperature: of q; any q keeps sampling exact, a q close to the target's p keeps more drafts.
        generator: torch.Generator for the draft samples.
    """

    def __init__(self, draft_model, *, do_sample: bool = True, temperature: float = 1.0,
                 generator: torch.Generator | None = None):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = draft_model.eval()
        self.do_sample, self.temperature, self.generator = do_sample, float(temperature), generator
        self.device = next(draft_model.parameters()).device
        self.cache = new_cache(draft_model)
        check_croppable(self.cache, draft_model)
        # sliding-window layers keep what speculative tokens evict; recurrent states are refused (propose)
        self.cache.activate_past_recording(**({"recurrent_states_to_keep": 0} if RECORDS_RECURRENT else {}))
        self._cache_arg = cache_argument(draft_model)
        self.tokens: list[int] = []      # every accepted token, prompt included

    def check_compatible(self, target_model) -> None:
        """Clear errors for a draft model that cannot serve this target."""
        if getattr(target_model.config, "is_encoder_decoder", False):
            raise ValueError(f"{type(target_model).__name__}: draft-model proposers are not supported for "
                             "encoder-decoder models; use the default lookup proposer")
        target_vocab, draft_vocab = vocab_size(target_model), vocab_size(self.model)
        if target_vocab != draft_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab} ids) differs from the target's "
                             f"({target_vocab}); the draft model must share the target's tokenizer")
        target_device = next(target_model.parameters()).device
        if target_device != self.device:
            raise ValueError(f"the draft model is on {self.device} but the target is on {target_device}; "
                             "move both to the same device")

    def extend(self, tokens) -> None:
        self.tokens.extend(as_token_array(tokens).tolist())

    def _forward(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model(input_ids=x, **{self._cache_arg: self.cache}, use_cache=True).logits[0, -1].float()

    @torch.inference_mode()
    def propose(self, max_tokens: int) -> Draft:
        """Up to max_tokens drafted tokens (no suffix match behind them: match_len 0), with q when sampled."""
        if max_tokens <= 0 or not self.tokens:
            return Draft(np.zeros(0, np.int32))
        cached = self.cache.get_seq_length()
        logits = self._forward(self.tokens[cached:])          # bring the cache up to every accepted token
        if has_recurrent_state(self.cache):
            raise UnsupportedCacheError(f"{type(self.model).__name__}: a draft model with a recurrent state cannot "
                                        "roll its drafts back; use a draft model with attention layers only")
        draft, rows = [], []
        for _ in range(max_tokens):
            q = torch.softmax(logits / self.temperature, -1)
            tok = (int(torch.multinomial(q, 1, generator=self.generator)) if self.do_sample else int(q.argmax()))
            draft.append(tok)
            rows.append(q)
            if len(draft) < max_tokens:
                logits = self._forward([tok])
        crop(self.cache, self.cache.get_seq_length() - len(self.tokens))   # drafts are speculative
        # An argmax draft is a point mass: q is not softmax(logits) there, and the point-mass rule is exact.
        return Draft(np.asarray(draft, dtype=np.int32), probs=torch.stack(rows) if self.do_sample else None)
