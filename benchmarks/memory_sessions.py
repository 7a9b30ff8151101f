"""Multi-request sessions for the memory benchmarks, built from ../shared/data (real texts written by others).

A session is a list of `Step`s replayed in order with one Memory (and References) shared by the
whole workload. A step with `score=False` only fills the memory (an earlier run, an earlier turn).
`group` names what a step measures, so single-shot controls and the target steps are reported apart.

Workloads (all outputs are real model or developer texts; none is written here):
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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.workloads import _jsonl, _maybe_list, _user, data_dir


@dataclass
class Step:
    messages: list[dict]
    output: str                  # the real continuation
    group: str                   # what the step measures
    score: bool = True


@dataclass
class Workload:
    name: str
    sessions: list[list[Step]]
    references: dict[str, str] = field(default_factory=dict)   # name -> text, registered before the first step


def _answers(file: str) -> dict[str, list[str]]:
    out = {}
    for row in _jsonl(data_dir() / "copyspec_mt_redundant" / "model_answer" / f"{file}.jsonl"):
        out[str(row["question_id"])] = _maybe_list(_maybe_list(row["choices"])[0]["turns"])
    return out


def _questions() -> dict[str, list[str]]:
    return {str(r["question_id"]): _maybe_list(r["turns"])
            for r in _jsonl(data_dir() / "copyspec_mt_redundant" / "question_redundant.jsonl")}


REDUNDANT = ["llama3-8B-experiments-redundant", "Qwen2.5-7B-Chat-large-redundant-1"]
RERUNS = [("llama3-8B-experiments", "llama3-8B-experiments-redundant"),
          ("Qwen2.5-7B-Chat-experiments-large-1", "Qwen2.5-7B-Chat-large-redundant-1"),
          ("Qwen25-72B-Chat-experiments-large", "Qwen25-72B-Chat-large-redundant")]


def mt_redundant(stateless: bool, limit: int | None) -> Workload:
    qs = _questions()
    sessions = []
    for file in REDUNDANT:                   # one session (one memory) per model's chats
        steps = []
        for qid, ans in list(_answers(file).items())[:limit]:
            t1, t2 = qs[qid][:2]
            if len(ans) < 2 or not ans[0].strip() or not ans[1].strip():
                continue
            steps.append(Step(_user(t1), ans[0], "turn1", score=not stateless))
            second = _user(t2) if stateless else [*_user(t1), {"role": "assistant", "content": ans[0]}, *_user(t2)]
            steps.append(Step(second, ans[1], "turn2"))
        sessions.append(steps)
    return Workload("mt_redundant_stateless" if stateless else "mt_redundant_history", sessions)


def rerun(limit: int | None) -> Workload:
    qs = _questions()
    sessions = []
    for first, second in RERUNS:
        a, b = _answers(first), _answers(second)
        steps = [Step(_user(qs[q][0]), a[q][0], "run1", score=False) for q in list(a)[:limit] if a[q][0].strip()]
        steps += [Step(_user(qs[q][0]), b[q][0], "run2") for q in list(b)[:limit] if q in qs and b[q][0].strip()]
        sessions.append(steps)
    return Workload("rerun", sessions)


def edits(limit: int | None, max_chars: int = 12000) -> Workload:
    steps = []
    rows = [r for r in _jsonl(data_dir() / "nofuneval_edit" / "nofuneval_edit.jsonl")
            if r.get("model_output") and r.get("target_code") and len(r["source_code"]) <= max_chars]
    for row in rows[:limit]:
        lang = row["pl"].lower()
        first = f"{row['instruction']}\n\n```{lang}\n{row['source_code']}\n```"
        message = str(row.get("commit_message") or "").strip("'\"\\n ") or "Apply the pending change."
        second = f"Edit the file: {message}. Write the entire code.\n\n```{lang}\n{row['source_code']}\n```"
        steps += [Step(_user(first), row["model_output"], "edit1"), Step(_user(second), row["target_code"], "edit2")]
    return Workload("edits", [steps])


def rag_clapnq(question_only: bool, limit: int | None) -> Workload:
    refs, steps = {}, []
    for row in list(_jsonl(data_dir() / "clapnq" / "clapnq_dev_answerable.jsonl"))[:limit]:
        passages = _maybe_list(row["passages"])
        context = "\n\n".join(p["text"] if isinstance(p, dict) else str(p) for p in passages)
        refs[f"clapnq/{row['id']}"] = context
        answers = _maybe_list(row["output"])
        ref = answers[0].get("answer") if answers and isinstance(answers[0], dict) else None
        if not ref:
            continue
        text = (f"Answer the question.\n\nQuestion: {row['input']}" if question_only else
                f"Answer the question using the passage.\n\nPassage:\n{context}\n\nQuestion: {row['input']}")
        steps.append(Step(_user(text), ref, "answer"))
    return Workload("rag_clapnq_question_only" if question_only else "rag_clapnq", [steps], refs)


WORKLOADS = {
    "mt_redundant_history": lambda limit: mt_redundant(False, limit),
    "mt_redundant_stateless": lambda limit: mt_redundant(True, limit),
    "rerun": rerun,
    "edits": edits,
    "rag_clapnq": lambda limit: rag_clapnq(False, limit),
    "rag_clapnq_question_only": lambda limit: rag_clapnq(True, limit),
}


def load(name: str, limit: int | None = None) -> Workload:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](limit)

