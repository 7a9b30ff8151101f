"""RequestCheck: vLLM's admission check of a request's lookup_decode settings (`request_args.parse`), so that a bad
value fails that request (`LLM.generate` raises vLLM's VLLMValidationError naming the key, into which vLLM turns
the check's ValueError; the OpenAI server answers 400) instead of being logged and ignored by the drafter.

vLLM validates every request against the `validate_params` of each logits processor it knows, and refuses
user-named logits processors when speculative decoding is on; installed plugins (the `vllm.logits_processors` entry
point group, which pyproject.toml registers this class under) are validated all the same. So this is a logits
processor that never changes logits: argmax-invariant, no state, `apply` returns its input. With speculation on,
vLLM never builds it (its workers skip custom logits processors then): it is only asked to validate.

This module imports vLLM; nothing but vLLM's plugin loader imports it.
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import LogitsProcessor

from lookup_decode.engines.vllm.request_args import parse


class RequestCheck(LogitsProcessor):
    """Fails a request whose extra_args hold a bad lookup_decode setting; changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
