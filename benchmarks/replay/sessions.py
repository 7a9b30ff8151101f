"""Multi-request sessions for the memory benchmarks, built from ../shared/data (real texts written by others).

The one builder of sessions for both memory benchmarks: `benchmarks.replay.memory` replays them on their real
outputs (`WORKLOADS`), `benchmarks.e2e.memory` generates every output with the model itself (`END_TO_END`).
A session is a list of `Step`s run in order with one Memory (and References) shared by the whole
workload. A step's messages may be built from the previous step's output, as a client would: the
replay passes the real previous output, an end-to-end run the model's own. A step with
`score=False` only fills the memory (an earlier run, an earlier turn). `group` names what a step
measures, so single-shot controls and the target steps are reported apart.

Replayed workloads (all outputs are real model or developer texts; none is written here):
* mt_redundant_history: MT-Redundant chats of one model (real answers): turn 1 = [t1] -> a1 (group
  "turn1": a single-shot control; memory holds earlier chats' answers), turn 2 = [t1, a1, t2] -> a2
  (group "turn2": history in the prompt, the usual chat API).
* mt_redundant_stateless: the same turn 2 sent as [t2] only (a client that does not resend the
  history; a1 is in memory from turn 1). The true continuation a2 was written by a model that saw
  the history, so this measures how much of it the memory can supply, not what a model without
  the history would write.
* rerun: the same MT-bench first turns answered in two separate runs of the same model (the data
  set's "experiments" and "redundant" answer files; same first turn, texts equal up to numerical
  noise): run 1 fills the memory, run 2 is scored. The "pipeline re-run" case of persistence.
* edits: NoFunEval files edited twice: the 33B model's rewrite for the data set's instruction
  (group "edit1"), then the real commit applied to the same original file (instruction = the commit
  message, output = the commit's after-code; group "edit2"; memory holds the first rewrite).
* rag_clapnq: every ClapNQ passage registered once as a reference document; each request carries
  its passage and question (the usual RAG prompt), output = the data set's answer.
* rag_clapnq_question_only: the same with the question only in the prompt (passages only in the
  references); like the stateless case, an upper bound of what references can supply.

End-to-end workloads (the same builders, sized for a CPU run of the default model):
* mt_redundant: mt_redundant_history over one model's chats (the model writes a1 itself).
* edits: successive edits of one small NoFunEval Python file: the data set's instruction, then two
  more real instructions of the set (speed, energy), each applied to the file as the previous step
  left it (only the first step has a real output).
* rag: rag_clapnq with the passages of the first 300 rows registered.
* rerun: the same first turns asked twice (greedy decoding repeats its answers).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.harness import workloads
from benchmarks.harness.workloads import data_dir, read_jsonl, redundant_answers, redundant_questions, user_turn


@dataclass
class Step:
    messages: list[dict] | Callable[[str], list[dict]]   # or built from the previous step's output text
    output: str | None           # the real continuation (None: none known; end-to-end runs only)
    group: str                   # what the step measures
    score: bool = True

    def prompt(self, previous: str) -> list[dict]:
        """The chat messages, given the output of the session's previous step ("" for the first)."""
        return self.messages(previous) if callable(self.messages) else self.messages


@dataclass
class Workload:
    name: str
    sessions: list[list[Step]]
    references: dict[str, str] = field(default_factory=dict)   # name -> text, registered before the first step


def _code(text: str) -> str:
    """The first fenced code block of a reply, or the reply itself."""
    m = re.search(r"```[a-zA-Z]*\n(.*?)(```|$)", text, re.S)
    return m.group(1) if m else text


REDUNDANT = ["llama3-8B-experiments-redundant", "Qwen2.5-7B-Chat-large-redundant-1"]
RERUNS = [("llama3-8B-experiments", "llama3-8B-experiments-redundant"),
          ("Qwen2.5-7B-Chat-experiments-large-1", "Qwen2.5-7B-Chat-large-redundant-1"),
          ("Qwen25-72B-Chat-experiments-large", "Qwen25-72B-Chat-large-redundant")]
EDIT_INSTRUCTIONS = [
    "Rewrite the given python program to optimize and improve the speed of execution. Write the entire code and no "
    "other text in the response.",
    "Rewrite the given python program to optimize and improve the energy usage. Write the entire code and no other "
    "text in the response.",
]


def mt_redundant(stateless: bool, limit: int | None, files=tuple(REDUNDANT)) -> Workload:
    """One session (one memory) per answer file: its chats' turn 1 and turn 2 in order."""
    qs = redundant_questions()
    sessions = []
    for file in files:
        steps = []
        for qid, ans in list(redundant_answers(file).items())[:limit]:
            t1, t2 = qs[qid][:2]
            if len(ans) < 2 or not ans[0].strip() or not ans[1].strip():
                continue
            steps.append(Step(user_turn(t1), ans[0], "turn1", score=not stateless))
            second = user_turn(t2) if stateless else \
                lambda a1, t1=t1, t2=t2: [*user_turn(t1), {"role": "assistant", "content": a1}, *user_turn(t2)]
            steps.append(Step(second, ans[1], "turn2"))
        sessions.append(steps)
    return Workload("mt_redundant_stateless" if stateless else "mt_redundant_history", sessions)


def rerun(limit: int | None, runs=tuple(RERUNS)) -> Workload:
    """One session per (first run, second run) pair of answer files: run 1 fills the memory, run 2 is scored."""
    qs = redundant_questions()
    sessions = []
    for first, second in runs:
        a, b = redundant_answers(first), redundant_answers(second)
        steps = [Step(user_turn(qs[q][0]), a[q][0], "run1", score=False) for q in list(a)[:limit] if a[q][0].strip()]
        steps += [Step(user_turn(qs[q][0]), b[q][0], "run2") for q in list(b)[:limit] if q in qs and b[q][0].strip()]
        sessions.append(steps)
    return Workload("rerun", sessions)


def _nofuneval(keep) -> list[dict]:
    return [r for r in read_jsonl(data_dir() / "nofuneval_edit" / "nofuneval_edit.jsonl") if keep(r)]


def edits(limit: int | None, max_chars: int = 12000) -> Workload:
    """Each file: the data set's instruction (33B model's rewrite), then its real commit on the original file."""
    steps = []
    rows = _nofuneval(lambda r: r.get("model_output") and r.get("target_code") and len(r["source_code"]) <= max_chars)
    for row in rows[:limit]:
        lang = row["pl"].lower()
        first = f"{row['instruction']}\n\n```{lang}\n{row['source_code']}\n```"
        message = str(row.get("commit_message") or "").strip("'\"\\n ") or "Apply the pending change."
        second = f"Edit the file: {message}. Write the entire code.\n\n```{lang}\n{row['source_code']}\n```"
        steps += [Step(user_turn(first), row["model_output"], "edit1"),
                  Step(user_turn(second), row["target_code"], "edit2")]
    return Workload("edits", [steps])


def edit_chain(limit: int | None, min_chars: int = 200, max_chars: int = 600) -> Workload:
    """Each small Python file edited three times in a row, every edit applied to the previous step's code."""
    steps = []
    rows = _nofuneval(lambda r: r["pl"].lower() == "python" and min_chars <= len(r["source_code"]) <= max_chars)
    for row in rows[:limit]:
        steps.append(Step(user_turn(f"{row['instruction']}\n\n```python\n{row['source_code']}\n```"),
                          row.get("model_output"), "edit1"))
        for i, instr in enumerate(EDIT_INSTRUCTIONS):
            steps.append(Step(lambda prev, instr=instr: user_turn(f"{instr}\n\n```python\n{_code(prev)}\n```"),
                              None, f"edit{i + 2}"))
    return Workload("edits", [steps])


def rag_clapnq(question_only: bool, limit: int | None, n_references: int | None = None) -> Workload:
    """ClapNQ answers, with the passages of the first n_references rows (default: the requests' own) registered."""
    reqs = workloads.clapnq()
    refs = {f"clapnq/{r.id}": r.meta["passages"] for r in reqs[:limit if n_references is None else n_references]}
    steps = [Step(user_turn(f"Answer the question.\n\nQuestion: {r.meta['question']}") if question_only
                  else r.messages, r.reference, "answer") for r in reqs[:limit] if r.reference]
    return Workload("rag_clapnq_question_only" if question_only else "rag_clapnq", [steps], refs)


# Real outputs at every step: what benchmarks.replay.memory replays.
WORKLOADS = {
    "mt_redundant_history": lambda limit: mt_redundant(False, limit),
    "mt_redundant_stateless": lambda limit: mt_redundant(True, limit),
    "rerun": rerun,
    "edits": edits,
    "rag_clapnq": lambda limit: rag_clapnq(False, limit),
    "rag_clapnq_question_only": lambda limit: rag_clapnq(True, limit),
}
# The model writes every output: what benchmarks.e2e.memory runs (limit = chats / files / questions).
END_TO_END = {
    "mt_redundant": lambda limit: mt_redundant(False, limit, files=REDUNDANT[:1]),
    "edits": edit_chain,
    "rag": lambda limit: rag_clapnq(False, limit, n_references=300),
    "rerun": lambda limit: rerun(limit, runs=[(REDUNDANT[0], REDUNDANT[0])]),
}


def load(name: str, limit: int | None = None, table: dict = WORKLOADS) -> Workload:
    if name not in table:
        raise KeyError(f"unknown workload {name!r}; choose from {', '.join(table)}")
    return table[name](limit)


def references(workload: Workload, tokenizer):
    """The workload's documents in one `References` (None when it has none)."""
    if not workload.references:
        return None
    from lookup_decode.sources.memory import References
    refs = References()
    for name, text in workload.references.items():
        refs.register(name, text, tokenizer=tokenizer)
    return refs
