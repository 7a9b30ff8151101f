"""The batch job, `lookup-decode run`: records from a JSONL or Parquet file through an engine into a JSONL that a
rerun resumes, on one machine or a Ray cluster.

    job.py      `Job` (what every worker needs), `run` (the driver), `Summary`, the local and Ray runners
    records.py  the record schema (`messages_of`, `id_of`, ...) and the job's input (`read_input`)
    output.py   `Output`: the output file, each record written exactly once
    hf.py       `HfEngine`: records through transformers' `generate` with lookup decoding (the default engine)
    vllm.py     `VllmEngine`: records through vLLM's offline `LLM` with `LookupDrafter` (`--engine vllm`)
"""
