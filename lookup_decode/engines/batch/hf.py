"""`lookup-decode run` (the default engine): the batch job's records through transformers' `generate`.

One `HfEngine` per process (the driver without --ray, each Ray actor with it) loads the model once; `run(items)`
groups the records by max_new_tokens and sends each group, `job.batch_size` records at a time, through the
batch path of `lookup_decode.generate` (left padding, ragged acceptance), greedy, so each text is the one plain
`model.generate(do_sample=False)` gives for that record alone (`--plain`: that plain call itself). A record that
cannot run (a prompt the model's context cannot hold, a generate call that fails for it) gets an error record.
"""

import os
import socket
import time

from lookup_decode.core.tokens import eos_ids, trim_at_eos
from lookup_decode.engines.batch.records import output_record, tokenized


class HfEngine:
    """One model in one process; `run(items)` turns work items into output records (never raises for a record)."""

    def __init__(self, job):
        from lookup_decode.engines.hf.models import load_quietly
        from lookup_decode.engines.vllm.settings import Settings  # the vLLM drafter's bound, for both engines
        from lookup_decode.sources.memory import Memory, load_references
        self.job = job
        # no GGUF progress bars; None: transformers' default here, float32
        self.model, self.tokenizer = load_quietly(job.model, job.threads, job.dtype or "float32")
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        self.eos = eos_ids(self.model.generation_config)
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        self.references = (load_references(job.references, tokenizer=self.tokenizer) if job.references else None)
        # The outputs of the records this worker ran, drafted from by the next ones (as vLLM's drafter does).
        self.memory = Memory(max_tokens=Settings.memory_tokens) if job.memory and not job.plain else None
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.batches = 0                  # generate calls so far

    def run(self, items: list[dict]) -> list[dict]:
        ready, out = tokenized(items, self.tokenizer, self.context, "the model's context", self.job.max_new_tokens)
        groups: dict[int, list] = {}                            # one max_new_tokens per generate call
        for r in ready:
            groups.setdefault(r[2], []).append(r)
        for n, group in groups.items():
            for i in range(0, len(group), self.job.batch_size):
                out.extend(self._batch(group[i:i + self.job.batch_size], n))
        return sorted(out, key=lambda r: r["line"])

    def _batch(self, group, max_new_tokens: int) -> list[dict]:
        try:
            return self._generate(group, max_new_tokens)
        except Exception as e:                                  # noqa: BLE001
            if len(group) > 1:                                  # find the record that fails; run the rest
                return [r for one in group for r in self._batch([one], max_new_tokens)]
            item = group[0][0]
            return [{"id": item["id"], "line": item["line"], "error": f"{type(e).__name__}: {e}"}]

    def _generate(self, group, max_new_tokens: int) -> list[dict]:
        import torch

        import lookup_decode
        P = max(len(ids) for _, ids, _ in group)
        input_ids = torch.full((len(group), P), self.pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for b, (_, ids, _) in enumerate(group):
            input_ids[b, P - len(ids):] = torch.tensor(ids)
            mask[b, P - len(ids):] = 1
        kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad)
        stats, start = None, time.perf_counter()
        with torch.inference_mode():
            if not self.job.plain:
                stats = lookup_decode.DecodeStats()
                predictions = [item.get("prediction") for item, _, _ in group]
                kwargs["custom_generate"] = lookup_decode.lookup_decoding(
                    self.job.lookup, stats=stats, references=self.references, memory=self.memory,
                    tokenizer=self.tokenizer, prediction=predictions if any(predictions) else None)
            out = self.model.generate(input_ids, **kwargs)
        seconds, self.batches = time.perf_counter() - start, self.batches + 1
        return [output_record(item, ids, trim_at_eos(out[b, P:], self.eos).tolist(), self.tokenizer,
                              stats.row_steps[b] if stats is not None else None, self.worker, self.batches, seconds)
                for b, (item, ids, _) in enumerate(group)]
