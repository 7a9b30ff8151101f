"""lookup_decode inside vLLM: the `custom_class` drafter (`drafter.LookupDrafter`), its settings, and batch jobs
run through vLLM's offline `LLM` (`batch`). Importable without vLLM: nothing here imports it at module level."""

from lookup_decode.engines.vllm.drafter import LookupDrafter, Settings

__all__ = ["LookupDrafter", "Settings"]
