"""KV-cache rollback through the public Cache API, and the one place that knows cache types.

Rejected draft tokens leave their keys/values at the end of the cache; `crop` removes them with
`Cache.crop(-n)` (transformers 5.x: a negative count drops tokens). Only caches whose every layer
keeps all past states can be cropped exactly; sliding-window, linear-attention, static and
encoder-decoder caches raise UnsupportedCacheError instead of silently producing other tokens.
"""

from __future__ import annotations

import inspect

import torch

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


def compact(cache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the hole columns of a batched cache; returns the new column mask.

    mask: bool [A, S], the valid columns of each row (holes are columns a row rejected while
    another row kept them). Each row's valid columns keep their order and move to the right end,
    as with left padding: [A, S] -> [A, S'] with S' = the most valid columns of any row. Positions
    were applied when the keys were computed, so moving columns changes nothing a row attends to.
    """
    width = int(mask.sum(1).max())
    # A stable sort of 0/1 puts each row's invalid columns first and its valid ones last, in order.
    index = torch.argsort(mask.to(torch.int8), dim=1, stable=True)[:, -width:]     # [A, S']
    def take(states):                                   # [A, heads, S, dim] -> [A, heads, S', dim]
        where = index.to(states.device)[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
        return states.gather(2, where)

    for layer in cache.layers:
        layer.keys, layer.values = take(layer.keys), take(layer.values)
    return mask.gather(1, index)
