"""Engine adapters, each thin and asking the core: transformers (`hf`), vLLM (`vllm`), the batch job
(`batch`) and the offline replay (`replay`, a forward that reads a recorded output)."""
