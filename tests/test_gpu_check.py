"""The prepared GPU check (benchmarks/micro/gpu_check.sh) on a CPU with tiny shapes, so it cannot rot."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.replay.forced import PAIRS, Forced, build, config_of, forced_replay, generate_pairs, load_pairs, remap  # noqa: E402


def test_gpu_check_dry_run_writes_tables_and_plot(tmp_path):
    # The script runs a bare `python`: this interpreter's, whether or not its venv is on PATH.
    env = {**os.environ, "DRY_RUN": "1", "OUT_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "micro" / "gpu_check.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for name in ("costs.json", "costs.md", "costs.png", "tiny_cpu.json", "tiny_cpu.md", "tiny-2_cpu.md",
                 "tiny-4_cpu.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "identical" in (tmp_path / "tiny_cpu.json").read_text()


def test_scaled_shapes_keep_the_vocabulary_and_head_layout():
    full, small = config_of("llama-3.1-8b"), config_of("llama-3.1-8b/8")
    assert small.vocab_size == full.vocab_size
    assert small.num_hidden_layers == 4 and small.hidden_size == small.num_attention_heads * small.head_dim
    assert small.num_attention_heads % small.num_key_value_heads == 0
    assert config_of("mistral-7b").sliding_window is None


def test_forced_logits_make_every_method_emit_the_record():
    """The hook forces the recorded tokens whatever decodes: plain, prompt lookup, lookup_decode (chain, tree)."""
    torch.set_num_threads(1)
    model = build("tiny")
    pairs = {"code_edit": [(p, o[:40]) for p, o in load_pairs(PAIRS, ["code_edit"], 1)["code_edit"]]}
    got = forced_replay(model, remap(pairs, model.config.vocab_size))   # raises if an output differs
    methods = got["code_edit"]["methods"]
    assert all(m["identical"] == 1 for m in methods.values())
    # Drafts were accepted: fewer steps than tokens (code edits copy their input).
    assert methods["lookup_decode"]["steps"] < methods["lookup_decode"]["tokens"]
    assert not model._forward_hooks                 # the hook is removed again


def test_remap_is_dense_only_when_needed():
    pairs = {"a": [(np.array([5, 70000]), np.array([70000, 5, 9]))]}
    assert remap(pairs, 100000) is pairs
    (p, o), = remap(pairs, 32000)["a"]
    assert p.tolist() == [0, 1] and o.tolist() == [1, 0, 2]


def test_forced_positions_follow_position_ids():
    model = build("tiny")
    forced = Forced(model)
    try:
        forced.set(np.array([3, 4, 5, 6, 7]), "cpu")
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([[3, 4]]), position_ids=torch.tensor([[2, 3]])).logits
        assert logits[0].argmax(-1).tolist() == [6, 7]
    finally:
        forced.handle.remove()


def test_a_generate_run_replays_plain_s_outputs_on_the_prompts_it_chose(tmp_path, capsys):
    """--from-generate: each prompt the run kept, rebuilt as the run chose it, paired with plain's recorded output;
    a category left out by --sets is left out."""
    import json
    from types import SimpleNamespace

    from benchmarks.harness import workloads
    from benchmarks.replay.forced import main as forced_main

    class Chars:
        def apply_chat_template(self, messages, **kwargs):
            return {"input_ids": torch.tensor([[ord(c) for c in messages[0]["content"]]])}

    def load(name):
        return [workloads.Request(name, f"{name}/{i}", [{"role": "user", "content": f"{name} {i}"}]) for i in range(3)]

    settings = {"workloads": ["qa", "cnn_dm"], "n_per_workload": 2, "max_prompt_tokens": 100, "max_new_tokens": 8,
                "seed": 0, "long_prompt_tokens": None}
    chosen, _ = workloads.select(settings["workloads"], Chars(), 2, 100, max_new_tokens=8, seed=0, load=load)
    prompts = [{"id": r.id, "plain_tokens": [i, i + 1]} for i, (r, _) in enumerate(chosen)]
    run = {"settings": settings, "prompts": prompts}
    model = SimpleNamespace(config=SimpleNamespace())          # no max_position_embeddings: no context bound
    pairs = generate_pairs(run, model, Chars(), load=load)
    assert sorted(pairs) == ["cnn_dm", "qa"] and sum(map(len, pairs.values())) == len(chosen) == 4
    for (req, ids), p in zip(chosen, prompts):
        prompt, output = next((a, b) for a, b in pairs[req.category] if a.tolist() == ids[0].tolist())
        assert output.tolist() == p["plain_tokens"] and prompt.dtype == np.int32
    assert list(generate_pairs(run, model, Chars(), sets=["qa"], load=load)) == ["qa"]

    # The command refuses a model or dtype other than the run's, before loading anything.
    path = tmp_path / "results.json"
    path.write_text(json.dumps({**run, "environment": {"model": "qwen2.5-coder-0.5b", "dtype": "bfloat16"}}))
    with pytest.raises(SystemExit):
        forced_main(["--from-generate", str(path), "--model", "qwen2.5-coder-0.5b"])      # float32 by default
    assert "that run decoded qwen2.5-coder-0.5b in bfloat16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        forced_main(["--from-generate", str(path), "--dtype", "bfloat16"])               # no --model
    assert "pass the same --model and --dtype" in capsys.readouterr().err
