"""KV-cache rollback through the public Cache API, and the one place that knows cache types.

Rejected draft tokens leave their keys/values at the end of the cache; `crop` removes them with
`Cache.crop(-n)` (transformers 5.x: a negative count drops tokens). Only caches whose every layer
keeps all past states can be cropped exactly; sliding-window, linear-attention, static and
encoder-decoder caches raise UnsupportedCacheError instead of silently producing other tokens.
"""

from __future__ import annotations

import inspect

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class UnsupportedCacheError(ValueError):
    """The model's cache cannot roll back rejected draft tokens exactly."""


def cache_argument(model) -> str:
    """Name of the forward() argument that takes the cache: 'cache' (transformers >= 5.x) or 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise UnsupportedCacheError(f"{type(model).__name__}.forward takes no KV cache argument")


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def check_croppable(cache, model) -> None:
    """Raise UnsupportedCacheError unless every layer of `cache` can drop its newest tokens exactly."""
    where = f"{type(model).__name__} with {type(cache).__name__}"
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"{where}: lookup decoding rolls back rejected drafts and supports DynamicCache only "
            f"(static and encoder-decoder caches are not supported yet)")
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:  # subclasses (sliding window, ...) drop states on their own
            raise UnsupportedCacheError(
                f"{where}: layer cache {type(layer).__name__} cannot roll back rejected draft tokens "
                f"exactly (sliding-window/hybrid caches are not supported yet)")


def crop(cache, n_remove: int) -> None:
    """Drop the newest `n_remove` tokens from every layer (no-op for 0)."""
    if n_remove > 0:
        cache.crop(-n_remove)
