"""Let vLLM's CPU build start in a process that imported numba, as every process that imported lookup_decode has.

vLLM 0.32's CPU worker, before it loads the model, rebinds its Triton kernels to C++ ones by scanning every
module's globals and reading `vars(value).get("kernel")` of each that has a `__dict__`
(vllm/triton_utils/dispatcher.py `_rebind_kernels`). llvmlite's `binding.ffi.lib` (numba loads it) answers
any missing attribute, `__dict__` included, from its C library, with a wrapped C function: `LLM()` dies with
"AttributeError: '_lib_fn_wrapper' object has no attribute 'get'". An empty `__dict__` in lib's own table of
names is what the scan then reads (nothing else asks lib for its `__dict__`).

Where it is needed: in every process that imported lookup_decode (numba) and then builds a vLLM engine, whether
lookup_decode builds it (`lookup-decode run --engine vllm`) or a script that imported the library first builds it
with vLLM's own `LLM` (no lookup_decode code runs then). So `lookup_decode/__init__.py` calls `survive_kernel_scan`
once its imports have loaded numba; tests/test_vllm_engine.py builds its reference engine that way
(`test_engine_builds_after_lookup_decode_was_imported`). Nothing here imports vLLM or numba.
"""

import sys


def survive_kernel_scan() -> None:
    """Give llvmlite's `ffi.lib` (if numba loaded it) the empty `__dict__` vLLM's kernel scan reads; idempotent."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
