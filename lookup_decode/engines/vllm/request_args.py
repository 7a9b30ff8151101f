"""What one vLLM request may ask of the drafter, in `SamplingParams.extra_args` (the OpenAI server's
`extra_body={"vllm_xargs": {...}}`, whose values are strings, numbers or lists of them):

    lookup_decode_k           int >= 0: the most draft tokens per step for this request (0: none; above the
                              engine's num_speculative_tokens, that number)
    lookup_decode_prediction  a text (tokenized with the engine's tokenizer, no special tokens) or a list of token
                              ids that the output is expected to repeat (OpenAI's Predicted Outputs): drafted from
                              by this request alone, and forgotten when it ends
    lookup_decode_scope       a non-empty string: the request drafts from the memory of outputs of its own scope
                              only, and its output enters that scope's memory alone (requests without one share
                              the default scope)

`parse` is the one reading of these keys: the drafter calls it when a request arrives (a bad value is logged once
and that setting ignored: vLLM gives a drafter no way to fail one request), and `request_check.RequestCheck`
calls it when vLLM admits the request, so that a bad value fails that request with an error naming the key
(`LLM.generate` raises vLLM's VLLMValidationError, the server answers 400). Other keys of extra_args are not
ours and are left alone; an unknown key with our prefix is an error (a misspelt setting must not pass silently).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "lookup_decode_"
K, PREDICTION, SCOPE = PREFIX + "k", PREFIX + "prediction", PREFIX + "scope"
KEYS = (K, PREDICTION, SCOPE)
MAX_SCOPE_CHARS = 256


@dataclass(frozen=True)
class RequestArgs:
    """One request's settings (None: not given, the engine's own)."""
    k: int | None = None                        # most draft tokens per step
    prediction: str | tuple[int, ...] | None = None   # a text, or token ids
    scope: str | None = None                    # the memory scope (None: the default one)


def parse(extra_args) -> RequestArgs:
    """The request's lookup_decode settings from its extra_args (a dict, or None). ValueError naming the key for
    a value of the wrong kind. Example: parse({"lookup_decode_k": "0", "other": 1}) -> RequestArgs(k=0)."""
    if not extra_args:
        return RequestArgs()
    if not isinstance(extra_args, dict):
        raise ValueError(f"extra_args must be a dict, got {type(extra_args).__name__}")
    unknown = sorted(key for key in extra_args if isinstance(key, str) and key.startswith(PREFIX) and key not in KEYS)
    if unknown:
        raise ValueError(f"unknown lookup_decode setting(s) {unknown} in extra_args; known: {list(KEYS)}")
    return RequestArgs(k=_k(extra_args.get(K)), prediction=_prediction(extra_args.get(PREDICTION)),
                       scope=_scope(extra_args.get(SCOPE)))


def _k(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lstrip("+").isdigit() or isinstance(value, float) \
            and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{K} must be an int >= 0 (0: no drafts for this request), got {value!r}")
    return value


def _prediction(value) -> str | tuple[int, ...] | None:
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, (list, tuple)) and all(_token_id(v) for v in value):
        return tuple(int(v) for v in value) or None
    raise ValueError(f"{PREDICTION} must be a text or a list of token ids (ints >= 0), got "
                     f"{shown(value)}")


def _token_id(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()) and v >= 0


def _scope(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SCOPE_CHARS:
        raise ValueError(f"{SCOPE} must be a non-empty string of at most {MAX_SCOPE_CHARS} characters, got "
                         f"{shown(value)}")
    return value


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
