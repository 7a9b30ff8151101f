"""lookup_decode inside vLLM: the `custom_class` drafter (`drafter.LookupDrafter`), the requests it follows
(`requests`), its settings (`settings`), and two fixes for vLLM's CPU build: its sampling kernel (`cpu_fix`) and
its kernel scan (`kernel_scan`). The batch job's vLLM engine is `engines.batch.vllm`. Importable without vLLM:
nothing here imports it at module level."""

from lookup_decode.engines.vllm.drafter import LookupDrafter, Settings

__all__ = ["LookupDrafter", "Settings"]
