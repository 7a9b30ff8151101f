"""KV-cache rollback through the public Cache API, and the one place that knows cache types and changes
cache layers: crop (rejected drafts), compaction (a batch's hole columns), the accepted path of a tree.

Rejected draft tokens leave their states at the end of the cache; `crop` removes them with
`Cache.crop(-n)` (transformers 5.x: a negative count drops tokens). Which path each layer type takes:

* DynamicLayer (full attention): the newest n keys/values are sliced off.
* StaticLayer (`cache_implementation="static"`, compile-friendly): the write position steps back by
  n; the stale slots are masked (causal mask over the fixed-size buffer) and overwritten next step.
* DynamicSlidingWindowLayer (Mistral with sliding_window, Gemma 2/3, Cohere2, ...) and conv-only
  linear-attention layers: after the prefill `start_rollback` turns on transformers' past recording,
  so a verify forward keeps the states it would evict until `crop` has dropped the rejected tokens
  and shrunk the layer back to its window (the mechanism transformers' own assisted decoding uses).
* Recurrent (SSM / linear attention) states, transformers >= 5.25: the same recording, told to keep the
  state after each token of a forward (`recurrent_states_to_keep`), so `crop` restores the state before
  the rejected tokens (Jamba, Bamba, Falcon-H1, Qwen3-Next, ... alongside attention layers). A model
  whose forward records no such states (Zamba in 5.25) is refused at its first rollback.
* Refused with UnsupportedCacheError naming model class and layer type: recurrent states before
  transformers 5.25 and in models with no attention layer at all, quantized layers, static
  sliding-window layers longer than their window.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, EncoderDecoderCache

try:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:     # transformers 4.56-4.57: no such layers, and no `is_croppable` (see _is_croppable)
    class LinearAttentionCacheLayerMixin:
        """Stands in for the layer type transformers 4.56-4.57 lack: no layer is one."""


# transformers >= 5.25 records a recurrent layer's per-token states for rollback when asked how many to keep.
RECORDS_RECURRENT = "recurrent_states_to_keep" in inspect.signature(
    getattr(LinearAttentionCacheLayerMixin, "activate_past_recording", lambda: None)).parameters


class UnsupportedCacheError(ValueError):
    """The model's cache cannot roll back rejected draft tokens exactly."""


def cache_argument(model) -> str:
    """Name of the forward() argument that takes the cache: 'cache' (transformers >= 5.x) or 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UnsupportedCacheError(f"{type(model).__name__}.forward takes no KV cache argument")


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def _layers(cache) -> list:
    # Encoder-decoder: only the decoder's self-attention states ever take draft tokens; the
    # cross-attention states (keys/values of the encoder output) are written once and never cropped.
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    return list(cache.layers)


def _refuse(cache, model, layer_names: list[str]) -> UnsupportedCacheError:
    names = ", ".join(sorted(set(layer_names)))
    hint = "use plain model.generate for this model/cache"
    if any(name.startswith("Static") for name in layer_names):
        hint = "the default dynamic cache rolls back (drop cache_implementation='static'), or use plain model.generate"
    return UnsupportedCacheError(
        f"{type(model).__name__} with {type(cache).__name__}: layer cache {names} cannot roll back rejected "
        f"draft tokens exactly; {hint}")


def check_croppable(cache, model) -> None:
    """Before the prefill: raise UnsupportedCacheError for caches that can never drop tokens exactly.

    Linear-attention layers are decided after the prefill (`start_rollback`): only then does the layer
    know whether it holds a recurrent state (not croppable) or conv states only (croppable).
    """
    if not isinstance(cache, Cache):
        raise UnsupportedCacheError(f"{type(model).__name__}: expected a transformers Cache, "
                                    f"got {type(cache).__name__}")
    layers = _layers(cache)
    bad = [type(layer).__name__ for layer in layers
           if not isinstance(layer, LinearAttentionCacheLayerMixin) and not _is_croppable(layer)]
    if layers and not any(isinstance(layer, CacheLayerMixin) for layer in layers):
        bad = [type(layer).__name__ for layer in layers]   # recurrent only (Mamba-like): no attention layer at all
    if bad:
        raise _refuse(cache, model, bad)
    if getattr(cache, "is_compileable", False) and any(isinstance(layer, LinearAttentionCacheLayerMixin)
                                                       for layer in layers):
        # Found by the differential fuzzer: LFM2 on a StaticCache of >= 256 positions gave other tokens than
        # plain generate (at >= 256 positions; exact at 100); refused until its rollback is understood and tested.
        raise UnsupportedCacheError(
            f"{type(model).__name__} with {type(cache).__name__}: conv/linear-attention layers on a static cache "
            f"are not rolled back exactly yet; the default dynamic cache works (drop cache_implementation='static')")


def start_rollback(cache, model, width: int = 1) -> None:
    """After the prefill: check every layer can roll back, then make windowed and recurrent layers keep their past.

    width: the most tokens a later forward holds. A recurrent layer then records the state after each of them
    (and computes them one token at a time, from the cached state: Jamba's multi-token scan would start from
    zeros), so `crop` can restore the state before any number of them. Recording starts only now so a long
    prompt does not keep states a sliding-window layer would drop (transformers' generate does the same).
    """
    bad = [type(layer).__name__ for layer in _layers(cache) if not _is_croppable(layer)]
    if bad:
        raise _refuse(cache, model, bad)
    if not hasattr(cache, "activate_past_recording"):   # transformers 4.x: only full-attention DynamicLayers get here
        return
    if not RECORDS_RECURRENT:
        cache.activate_past_recording()
        return
    cache.activate_past_recording(recurrent_states_to_keep=width)
    for layer in _layers(cache):                # 5.25 gives every state of a layer one shared history list
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.recurrent_states_history = {i: [] for i in layer.recurrent_states_history}


def has_recurrent_state(cache) -> bool:
    """True when a layer holds a recurrent state (transformers >= 5.25 rolls it back, `start_rollback`)."""
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) and any(layer.is_recurrent_states_initialized.values())
               for layer in _layers(cache))


def _is_croppable(layer) -> bool:
    """transformers 5.x says it; 4.56-4.57 have no past recording, so only full-attention DynamicLayers roll back."""
    croppable = getattr(layer, "is_croppable", None)
    return type(layer) is DynamicLayer if croppable is None else bool(croppable)


def crop(cache, n_remove: int, width: int | None = None, model=None) -> None:
    """Drop the newest `n_remove` tokens from every layer; width: the tokens of the forward since the last crop.

    Called for 0 too: sliding-window and conv layers recording their past shrink back to their window.
    A recurrent layer must hold one recorded state per token of that forward (the state before it, then
    after each but the last); a model whose forward recorded fewer would be put back to a wrong state.
    """
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache   # its crop() refuses static caches; the cross-attention part never changes
    if n_remove == 0 and not hasattr(cache, "activate_past_recording"):
        return                               # transformers 4.x reads crop(-0) as crop(0): empty the cache
    if width is not None:
        short = [type(layer).__name__ for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
                 for i, states in getattr(layer, "recurrent_states_history", {}).items()
                 if layer.is_recurrent_states_initialized[i] and len(states) != width]
        if short:
            raise UnsupportedCacheError(f"{type(model).__name__}: layer cache {short[0]} did not record the recurrent "
                                        f"states of its last forward, so rejected draft tokens cannot be rolled back "
                                        f"exactly; use plain model.generate for this model")
    cache.crop(-n_remove)


def full_attention(cache, model) -> bool:
    """True when every layer is a full-attention DynamicLayer: the only caches a tree's 4-D mask and
    `keep_tree_path` are exact on (a sliding window would be ignored by the mask; a conv layer would
    read the tree's nodes as one sequence), and the only ones a batch's hole columns fit (`check_batchable`)."""
    if isinstance(cache, EncoderDecoderCache) or not isinstance(cache, DynamicCache):
        return False
    windowed = getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True)
    return not windowed and all(type(layer) is DynamicLayer for layer in cache.layers)


def check_batchable(cache, model) -> None:
    """Batches keep masked hole columns (forward.BatchForward): only full-attention DynamicLayers index keys by column.

    A sliding window counts columns, not a row's own tokens, and an encoder-decoder or static cache
    has its own layout, so these raise UnsupportedCacheError for batch > 1 (one row at a time works).
    """
    if getattr(model.config, "is_encoder_decoder", False) or not full_attention(cache, model):
        layers = ", ".join(sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])}))
        raise UnsupportedCacheError(f"{type(model).__name__} with {type(cache).__name__}: batched lookup decoding "
                                    f"needs a decoder-only model whose DynamicCache has full-attention layers only "
                                    f"(got {layers or 'none'}); generate one row at a time")


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


def keep_tree_path(cache, past: int, path: list[int], n_nodes: int) -> None:
    """After a tree forward: keep the past, the root and the accepted nodes' keys/values; drop the other nodes.

    The cache holds past + 1 + n_nodes positions (the forward over [root, nodes]) on entry.
    """
    keep = torch.cat([torch.arange(past + 1), past + 1 + torch.tensor(path, dtype=torch.long)])
    for layer in _layers(cache):
        if not isinstance(layer, DynamicLayer) or layer.keys.shape[-2] != past + 1 + n_nodes:
            raise UnsupportedCacheError(f"tree verification needs full-attention DynamicLayers holding "
                                        f"{past + 1 + n_nodes} positions, got {type(layer).__name__}")
        layer.keys, layer.values = (x.index_select(-2, keep.to(x.device)) for x in (layer.keys, layer.values))
