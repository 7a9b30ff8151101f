"""A LookupDrafter whose work fails on some steps, for the failure test of the real engine
(`speculative_config={"model": "vllm_faulty.FaultyDrafter", ...}`, tests/ on sys.path).

`_draft` (the drafter's work, wrapped by `BatchDrafter.draft`, which `propose` calls) raises on its calls number
FAIL_AT (1-based); `results` keeps the draft lengths the public `propose` returned on every call, so a test can
check what the engine got on the failing steps.
"""

from lookup_decode.vllm import LookupDrafter

FAIL_AT = (3, 6)


class FaultyDrafter(LookupDrafter):
    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.calls = 0
        self.results: list[list[int]] = []      # per propose call: draft length per row

    def _draft(self, *args, **kwargs):
        self.calls += 1
        if self.calls in FAIL_AT:
            raise RuntimeError(f"vllm_faulty: deliberate failure on call {self.calls}")
        return super()._draft(*args, **kwargs)

    def propose(self, *args, **kwargs):
        drafts = super().propose(*args, **kwargs)
        self.results.append([len(d) for d in drafts])
        return drafts
