"""A fix for vLLM's CPU build that sampling with drafts needs (applied when the drafter is built).

Without Triton-CPU, vLLM 0.32's CPU platform replaces its Triton kernels with C++ ones
(`CpuPlatform.register_triton_kernel_overrides`). The replacement of the rejection sampler's `expand_kernel`
(vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`) hands the C++ op int64 copies of its tensors; for the
float32 temperatures and top-p values (and int32 top-k) that `expand_batch_to_tokens` spreads over draft
positions, the result is written into a copy and thrown away, and the caller reads uninitialised memory. Every
draft position of a sampled request is then sampled from a wrong distribution, and a single sampled request in
a batch also corrupts its greedy rows (those are scaled by the same garbage). With the drafter loaded, that
would make lookup decoding worse than plain decoding; vLLM's own n-gram and suffix drafters are hit the same way.

The fix points the override vLLM installed for that kernel (a `vllm.triton_utils.dispatcher.KernelOverride`,
which every reference to the kernel now holds) at a correct torch implementation, and only after a self-test
shows the installed kernel is wrong, so a fixed vLLM, a GPU build or Triton-CPU are left alone. (vLLM's own
`register_kernels` cannot be called a second time in a process that imported more modules since: its scan of
sys.modules fails on a torch object whose `vars()` is no dict.)
"""

from __future__ import annotations

import logging

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
log = logging.getLogger("lookup_decode.vllm")


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:  # noqa: N803  (the kernel's own parameter name)
    """output[cu[i - 1]:cu[i]] = input_val[i] (replace_from replaced by replace_to), any dtype, in place."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(counts.sum())
    output[:n] = torch.repeat_interleave(values, counts).to(output.dtype)


def _broken() -> bool:
    """Whether vLLM's expand (as the rejection sampler calls it) loses float values on this platform."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
    got = expand_batch_to_tokens(torch.tensor([0.7, 0.25], dtype=torch.float32),
                                 torch.tensor([2, 5], dtype=torch.int32), 5)
    return not torch.equal(got, torch.tensor([0.7, 0.7, 0.25, 0.25, 0.25], dtype=torch.float32))


def apply() -> bool:
    """Install the fix where vLLM's CPU expand kernel is broken; True if it was installed. Never raises: a vLLM
    without these modules has nothing to fix."""
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu() or not _broken():
            return False
        from vllm.triton_utils.dispatcher import KernelOverride
        from vllm.v1.sample import rejection_sampler
        override = rejection_sampler.expand_kernel
        if not isinstance(override, KernelOverride):
            raise TypeError(f"{KERNEL} is a {type(override).__name__}, not vLLM's KernelOverride")
        override._impl = override.func = expand
        override._forward_by_name = False              # launched with the kernel's arguments, in its order
        if _broken():
            raise RuntimeError("the replaced kernel still loses float values")
    except Exception as e:                              # noqa: BLE001  (another vLLM: nothing we know to fix)
        log.warning("lookup_decode: could not check or replace vLLM's CPU expand kernel (%s: %s); sampled requests "
                    "with speculative decoding may not follow the model's distribution on this build",
                    type(e).__name__, e)
        return False
    log.warning("lookup_decode: replaced vLLM's CPU rejection-sampler expand kernel, which loses float values "
                "(temperature, top-p at draft positions); sampled requests now follow the model's distribution")
    return True

