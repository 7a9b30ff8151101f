"""A request record, the one schema the batch job (`lookup-decode run`) and `lookup-decode bench` read:

    {"id": "a1", "prompt": "Summarise: ..."}                                  # the user message
    {"id": 7, "messages": [{"role": "user", "content": "..."}], "max_new_tokens": 128}
    {"id": "e3", "prompt": "Rename f to g:\n<code>", "prediction": "<code>"}   # drafts from the prediction

`prompt` is sent as the user message through the chat template; `messages` are chat messages as they are.
`id` (a string or an integer), `max_new_tokens` (an integer >= 1) and `prediction` (a text the output is expected
to repeat, as OpenAI's Predicted Outputs: drafted from for this record alone) are read by the batch job; bench
needs none of them. Each function raises `RecordError` naming the field that is wrong. `read_input` turns a whole
file into the job's work items and error records; `key_of` is a record's identity in the input and the output. An
engine turns work items into prompts with `tokenized` and what it generated into output records with
`output_record`.
"""

from __future__ import annotations

import json
from pathlib import Path


class RecordError(ValueError):
    """A record that does not follow the schema; the message names the field."""


def read_rows(path) -> list[tuple[int, object]]:
    """(line, row) for every record of a JSONL file (1-based line numbers; blank lines skipped) or of a Parquet
    file (.parquet: 1-based row numbers, null fields left out). A line that is not JSON gets a RecordError in
    place of its row, so the caller decides whether one bad line ends the run. FileNotFoundError: no file.

    JSON Lines end lines with \n (or \r\n) only: U+2028, U+2029, \x85 ... are legal inside a JSON string and do
    not end a line (str.splitlines() would split there)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return [(i, {k: v for k, v in row.items() if v is not None})
                for i, row in enumerate(pq.read_table(path).to_pylist(), start=1)]
    rows = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rows.append((i, json.loads(raw.decode("utf-8"))))
            except UnicodeDecodeError as e:
                rows.append((i, RecordError(f"cannot read the line as UTF-8 text: {e}")))
            except json.JSONDecodeError as e:
                rows.append((i, RecordError(f"not valid JSON: {e}")))
    return rows


def messages_of(row) -> list[dict]:
    """The chat messages of a record: its `messages` (checked, copied as {"role", "content"}) or its `prompt`
    as one user message. Parquet list columns (numpy arrays) are accepted as lists."""
    if not isinstance(row, dict):
        raise RecordError(f"expected a JSON object, got {type(row).__name__}")
    messages, prompt = row.get("messages"), row.get("prompt")
    if messages is not None:
        if hasattr(messages, "tolist"):
            messages = messages.tolist()
        if not isinstance(messages, list) or not messages:
            raise RecordError("'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RecordError("each of 'messages' must be an object with string 'role' and 'content': "
                                  f"messages[{i}] is not")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise RecordError("'prompt' must be a non-empty string")
        return [{"role": "user", "content": prompt}]
    raise RecordError("missing field: each record needs 'prompt' (a string) or 'messages' (a list)")


def id_of(row: dict):
    """The record's `id`: a string or an integer."""
    if row.get("id") is None:
        raise RecordError("missing field 'id'")
    if not isinstance(row["id"], (str, int)) or isinstance(row["id"], bool):
        raise RecordError(f"'id' must be a string or an integer, got {type(row['id']).__name__}")
    return row["id"]


def max_new_tokens_of(row: dict) -> int | None:
    """The record's own `max_new_tokens` (None: the job's default). Parquet ints may arrive as numpy or float."""
    n = row.get("max_new_tokens")
    if n is None:
        return None
    try:
        ok = not isinstance(n, bool) and float(n) == int(n) and int(n) >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise RecordError(f"'max_new_tokens' must be an integer >= 1, got {n!r}")
    return int(n)


def prediction_of_record(row: dict) -> str | None:
    """The record's own `prediction` (None: none)."""
    text = row.get("prediction")
    if text is not None and (not isinstance(text, str) or not text):
        raise RecordError(f"'prediction' must be a non-empty string, got {type(text).__name__}")
    return text


# ------------------------------------------------------------------------------------------ the job's input

def key_of(record: dict) -> str:
    """Identity of an output/input record: its id, else (no id could be read) its line."""
    return "id:" + json.dumps(record["id"], sort_keys=True) if "id" in record else f"line:{record['line']}"


def _validate(row, line: int) -> dict:
    """A work item {"id", "line", "messages", "max_new_tokens", "prediction"} or an error record {"id"?, "line",
    "error"}."""
    out = {"line": line}
    try:
        if not isinstance(row, dict):
            messages_of(row)                         # names what it got
        out["id"] = id_of(row)
        return {**out, "messages": messages_of(row), "max_new_tokens": max_new_tokens_of(row),
                "prediction": prediction_of_record(row)}
    except RecordError as e:
        return {**out, "error": str(e)}


def read_input(path: str | Path) -> list[dict]:
    """Work items and error records for every record of a JSONL or Parquet file (`read_rows`; line =
    1-based line or row number). Duplicate ids: the later ones are errors."""
    items = [{"line": i, "error": str(row)} if isinstance(row, RecordError) else _validate(row, i)
             for i, row in read_rows(path)]
    first = {}
    for j, item in enumerate(items):
        if "id" in item:
            key = key_of(item)
            if key in first:
                # keyed by its line, not its id: the first record with this id must still run
                items[j] = {"line": item["line"], "error": f"duplicate id {item['id']!r} (first at line {first[key]})"}
            else:
                first[key] = item["line"]
    return items


# ------------------------------------------------------------------------------ an engine's prompts and records

def tokenized(items, tokenizer, limit: int | None, limit_name: str, max_new_tokens: int):
    """The batch job's pending records as prompts, the same for every engine: (ready, errors). `ready` holds
    (item, token ids, max_new_tokens) for each item (a dict with id, line, messages, maybe max_new_tokens) whose
    prompt the tokenizer makes (the model's chat template, `models.chat_ids`) and whose prompt is shorter than
    `limit` tokens (None: no bound; `limit_name` names it in the error, e.g. "the model's context"); `errors` holds
    an error record ({"id", "line", "error"}) for each other item."""
    from lookup_decode.engines.hf.models import chat_ids
    ready, errors = [], []
    for item in items:
        base = {"id": item["id"], "line": item["line"]}
        try:
            ids = chat_ids(tokenizer, item["messages"])[0].tolist()
        except Exception as e:                              # noqa: BLE001  (the record's own error)
            errors.append({**base, "error": f"cannot tokenize: {type(e).__name__}: {e}"})
            continue
        if limit is not None and len(ids) >= limit:
            errors.append({**base, "error": f"prompt has {len(ids)} tokens; {limit_name} is {limit}"})
            continue
        ready.append((item, ids, int(item.get("max_new_tokens") or max_new_tokens)))
    return ready, errors


def output_record(item, prompt_ids, new: list[int], tokenizer, steps: int | None, worker: str, batch: int,
                  seconds: float) -> dict:
    """The output record of an item whose engine generated `new` (token ids, cut after the first EOS) in `steps`
    verify steps (None: no lookup), in its `batch`-th generate call on `worker`, which took `seconds`."""
    return {"id": item["id"], "line": item["line"], "text": tokenizer.decode(new, skip_special_tokens=True),
            "new_tokens": len(new), "prompt_tokens": len(prompt_ids),
            # tokens per verify step, the bonus token included (the prefill's first token excluded)
            "mean_accepted_length": None if steps is None else round((len(new) - 1) / steps, 4) if steps else 1.0,
            "steps": steps, "worker": worker,
            # the generate call (vLLM: the engine run) that made this record: its number on this worker and its seconds
            "batch": batch, "batch_s": round(seconds, 4)}
