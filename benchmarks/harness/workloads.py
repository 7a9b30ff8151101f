"""Benchmark workloads from ../shared/data (real data written by others; see its README).

Each loader returns `Request`s: chat messages for the model's chat template, plus the real
reference output of a large model where the data set has one (for offline replay); `select` is the one way a
study picks its prompts (per workload, in the data's or a seeded order, under a token cap); `real_pairs`
tokenizes the references into the (prompt, output) pairs the replays run on.
Set LOOKUP_DECODE_DATA to point elsewhere; the default is the `shared/data` folder beside the repo.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def data_dir() -> Path:
    env = os.environ.get("LOOKUP_DECODE_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass
class Request:
    category: str                      # workload name, e.g. "code_edit", "summarization"
    id: str
    messages: list[dict]               # [{"role": "user", "content": ...}, ...]
    reference: str | None = None       # a real model's output for these messages, when known
    meta: dict = field(default_factory=dict)


def read_jsonl(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def maybe_list(value):
    """Some sets store lists as their Python repr; parse those."""
    if isinstance(value, str) and value[:1] == "[":
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return [value]
    return value


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def spec_bench(category: str) -> list[Request]:
    """Spec-Bench first turns; category in summarization, rag, qa, translation, math_reasoning, mt_bench."""
    mt = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    out = []
    for row in read_jsonl(data_dir() / "spec_bench" / "question.jsonl"):
        cat = "mt_bench" if row["category"] in mt else row["category"]
        if cat != category:
            continue
        turns = maybe_list(row["turns"])
        out.append(Request(category, str(row["question_id"]), user_turn(turns[0])))
    return out


def nofuneval_edit() -> list[Request]:
    """Whole-file code edits; reference = deepseek-coder-33b's real output."""
    out = []
    for row in read_jsonl(data_dir() / "nofuneval_edit" / "nofuneval_edit.jsonl"):
        text = f"{row['instruction']}\n\n```{row['pl'].lower()}\n{row['source_code']}\n```"
        out.append(Request("code_edit", row["id"], user_turn(text), row.get("model_output"),
                           {"source_chars": len(row["source_code"]), "source_code": row["source_code"],
                            "instruction": row["instruction"]}))
    return out


def editeval() -> list[Request]:
    """Short instruction + code edits (InstructCoder EditEval); reference = the real after-code."""
    out = []
    for row in read_jsonl(data_dir() / "instructcoder_editeval" / "edit_eval.jsonl"):
        text = f"{row['instruction']}\n\n```python\n{row['input']}\n```"
        out.append(Request("editeval", row["task_id"], user_turn(text), row.get("output")))
    return out


def aider_refactor() -> list[Request]:
    """Refactoring requests over large real source files (long context); no reference."""
    out = []
    for row in read_jsonl(data_dir() / "aider_refactor" / "refactor_benchmark.jsonl"):
        text = f"{row['instruction']}\n\n```python\n{row['before_code']}\n```"
        out.append(Request("aider_refactor", row["id"], user_turn(text), None,
                           {"source_chars": len(row["before_code"])}))
    return out


def clapnq() -> list[Request]:
    """Retrieval QA: passages + question; reference = the data set's long answer; meta: passages, question."""
    out = []
    for row in read_jsonl(data_dir() / "clapnq" / "clapnq_dev_answerable.jsonl"):
        context = "\n\n".join(p["text"] if isinstance(p, dict) else str(p) for p in maybe_list(row["passages"]))
        answers = maybe_list(row["output"])
        ref = answers[0].get("answer") if answers and isinstance(answers[0], dict) else None
        text = f"Answer the question using the passage.\n\nPassage:\n{context}\n\nQuestion: {row['input']}"
        out.append(Request("clapnq", str(row["id"]), user_turn(text), ref,
                           {"passages": context, "question": row["input"]}))
    return out


def redundant_answers(file: str) -> dict[str, list[str]]:
    """A CopySpec answer file's turns per question id (`file` without .jsonl)."""
    return {str(r["question_id"]): maybe_list(maybe_list(r["choices"])[0]["turns"])
            for r in read_jsonl(data_dir() / "copyspec_mt_redundant" / "model_answer" / f"{file}.jsonl")}


def redundant_questions() -> dict[str, list[str]]:
    """CopySpec's redundant questions: the turns per question id."""
    return {str(r["question_id"]): maybe_list(r["turns"])
            for r in read_jsonl(data_dir() / "copyspec_mt_redundant" / "question_redundant.jsonl")}


def mt_redundant() -> list[Request]:
    """Second turns that re-ask for earlier content; the first answer is a real model's; reference = its 2nd turn."""
    answers = redundant_answers("llama3-8B-experiments-redundant")
    out = []
    for qid, turns in redundant_questions().items():
        ans = answers.get(qid)
        if not ans or len(turns) < 2:
            continue
        messages = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": ans[0]},
                    {"role": "user", "content": turns[1]}]
        out.append(Request("mt_redundant", qid, messages, ans[1] if len(ans) > 1 else None))
    return out


def _pld(name: str, category: str) -> list[Request]:
    rows = json.loads((data_dir() / "pld_outputs" / name).read_text())
    out = []
    for i, row in enumerate(rows):
        prompt = row["prompt"]
        prompt = prompt[0] if isinstance(prompt, list) else prompt
        prompt = prompt.replace("[INST]", "").replace("[/INST]", "").strip()
        resp = maybe_list(row["response_mistral7b"])
        ref = resp[0]["response_text"].strip() if resp else None
        out.append(Request(category, f"{category}/{i}", user_turn(prompt), ref))
    return out


def cnn_dm() -> list[Request]:
    """CNN/DM summaries; reference = Mistral-7B's real greedy output."""
    return _pld("cnn_dm_outputs.json", "cnn_dm")


def mt_bench_pld() -> list[Request]:
    """MT-bench first turns with real outputs (chat): reference = Mistral-7B's real greedy output (Spec-Bench's
    mt_bench rows have none)."""
    return _pld("mt_bench_output.json", "mt_bench_pld")


def hagrid() -> list[Request]:
    """HAGRID retrieval QA; reference = Mistral-7B's real greedy output."""
    return _pld("hagrid_outputs.json", "hagrid")


def humaneval() -> list[Request]:
    """Code generation from a docstring: little to copy (a control)."""
    return [Request("humaneval", row["task_id"],
                    user_turn(f"Complete this Python function.\n\n```python\n{row['prompt']}```"),
                    row["prompt"] + row["canonical_solution"])
            for row in read_jsonl(data_dir() / "humaneval" / "HumanEval.jsonl.gz")]


def qmsum(max_chars: int = 12000) -> list[Request]:
    """Meeting transcript + query, transcript cut to max_chars: long input, little copying (a control)."""
    out = []
    for i, row in enumerate(read_jsonl(data_dir() / "qmsum" / "test.jsonl")):
        turns = maybe_list(row["meeting_transcripts"])
        transcript = "\n".join(f"{t['speaker']}: {t['content']}" for t in turns)[:max_chars]
        query = maybe_list(row["specific_query_list"])[0]
        text = f"Meeting transcript:\n{transcript}\n\n{query['query']}"
        out.append(Request("qmsum", f"qmsum/{i}", user_turn(text), query.get("answer")))
    return out


WORKLOADS = {
    "code_edit": nofuneval_edit,
    "editeval": editeval,
    "aider_refactor": aider_refactor,
    **{c: functools.partial(spec_bench, c)
       for c in ("summarization", "rag", "qa", "translation", "math_reasoning", "mt_bench")},
    "mt_bench_pld": mt_bench_pld,
    "clapnq": clapnq,
    "mt_redundant": mt_redundant,
    "cnn_dm": cnn_dm,
    "hagrid": hagrid,
    "humaneval": humaneval,
    "qmsum": qmsum,
}


def load(name: str) -> list[Request]:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()


LONG = ("aider_refactor",)          # long-context workloads: `select`'s long_prompt_tokens cap applies to them


def select(names: list[str], tokenizer, n: int | None = None, max_prompt_tokens: int | None = None, *,
           context: int | None = None, max_new_tokens: int = 0, seed: int | None = None,
           long_prompt_tokens: int | None = None, encode=None, load=load):
    """The prompts of a study: per workload, the first n requests (None: all) whose prompt fits, in the data's
    order or (seed given) a random.Random(seed) shuffle of it. Returns (chosen [(Request, ids long [1, T])],
    skipped {workload: requests passed over for length}).

    A prompt fits when it has at most max_prompt_tokens tokens (None: any; the LONG workloads: long_prompt_tokens
    when given) and, with context given, prompt + max_new_tokens fits in it. encode: Request -> ids [1, T], what
    is measured and returned (default: the chat template, `chat_ids`). load: name -> requests.

    Example: select(["code_edit"], tok, 2, 1024, seed=0) -> the first two NoFunEval edits of a seeded shuffle
    whose chat prompt has <= 1,024 tokens.
    """
    if encode is None:
        from lookup_decode.engines.hf.models import chat_ids

        def encode(req):
            return chat_ids(tokenizer, req.messages)
    chosen, skipped = [], {}
    for name in names:
        reqs = load(name)
        if seed is not None:
            random.Random(seed).shuffle(reqs)
        cap = long_prompt_tokens if name in LONG and long_prompt_tokens else max_prompt_tokens
        taken, skipped[name] = 0, 0
        for req in reqs:
            if taken == n:
                break
            ids = encode(req)
            t = ids.shape[1]
            if (cap is not None and t > cap) or (context and t + max_new_tokens > context):
                skipped[name] += 1
                continue
            chosen.append((req, ids))
            taken += 1
    return chosen, skipped


def eos_of(tokenizer) -> list[int]:
    """The tokenizer's EOS id as the list drafters take (empty when it has none)."""
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def real_pairs(tokenizer, sets: list[str], limit: int | None = None, min_tokens: int = 1,
               progress: bool = False) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Per set: (prompt int32 [T], output int32 [n]) for the first `limit` requests with a real reference
    output (a large model's, or the data set's), then only outputs of at least min_tokens tokens.

    The prompt goes through the chat template, the output is tokenized as plain text.
    """
    from tqdm import tqdm

    from lookup_decode.engines.hf.models import chat_ids
    pairs = {}
    for name in sets:
        reqs = [r for r in load(name) if r.reference and r.reference.strip()][:limit]
        got = [(chat_ids(tokenizer, r.messages)[0].numpy().astype(np.int32),
                np.asarray(tokenizer(r.reference, add_special_tokens=False)["input_ids"], dtype=np.int32))
               for r in tqdm(reqs, desc=f"tokenize {name}", leave=False, disable=not progress)]
        pairs[name] = [(p, o) for p, o in got if len(o) >= min_tokens]
    return pairs
