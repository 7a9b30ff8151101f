"""lookup_decode inside vLLM: the `custom_class` drafter (`drafter.LookupDrafter`, the adapter that reads vLLM's
objects) over the engine-neutral `batch_drafter.BatchDrafter`, its memory keeper (`keeper`), counters (`stats`),
the requests it follows (`requests`), its settings (`settings`, `request_args`, `request_check`), and two fixes for
vLLM's CPU build: its sampling kernel (`cpu_fix`) and its kernel scan (`kernel_scan`). The batch job's vLLM engine
is `engines.batch.vllm`. Importable without vLLM: nothing here imports it at module level."""

from lookup_decode.engines.vllm.drafter import LookupDrafter, Settings

__all__ = ["LookupDrafter", "Settings"]
