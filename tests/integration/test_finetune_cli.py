"""`compushare finetune` as a user runs it: it trains through the swarm with a
progress line per step, checkpoints, resumes after a kill to the very adapter an
uninterrupted run gives, writes an adapter PEFT loads, and refuses bad data clearly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from compushare.model import adapter_file
from compushare.model.catalog import import_path
from helpers import wait_until

pytestmark = pytest.mark.integration


def finetune_command(client, boot, data, out, *extra):
    return [sys.executable, "-m", "compushare", "finetune", "--model", "tiny", "--data", str(data), "--out", str(out),
            "--data-dir", str(client), "--bootstrap", boot, "--steps", "10", "--checkpoint-every", "2",
            "--seq-len", "16", "--batch-size", "2", "--accumulate", "2", "--lr", "0.01", "--spot-check", "0",
            "--targets", "q_proj,v_proj,down_proj", *extra]


def run(cmd, timeout=240):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_finetune_trains_checkpoints_and_resumes_after_a_kill(processes, worded_model, tmp_path):
    _, first = processes.node("a", worded_model, "0:2")
    boot = first["addrs"][0]
    processes.node("b", worded_model, "2:4", bootstrap=[boot])
    client = tmp_path / "client"
    import_path(worded_model, client, alias="tiny")
    data = tmp_path / "data.txt"
    data.write_text(" ".join(f"w{4 + (i * 7) % 40}" for i in range(1200)) + "\n")  # a learnable cycle

    whole = run(finetune_command(client, boot, data, tmp_path / "whole.safetensors"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert "step 10/10" in whole.stderr and "held-out loss" in whole.stderr
    before, after = (float(x) for x in whole.stderr.split("held-out loss ")[1].split()[0:3:2])
    assert after < before

    out = tmp_path / "resumed.safetensors"
    killed = subprocess.Popen(finetune_command(client, boot, data, out), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    state = out.with_name(out.name + ".ckpt") / "state.json"
    try:
        wait_until(lambda: state.exists() and json.loads(state.read_text())["step"] >= 4, "a checkpoint at step 4",
                   timeout=180, interval=0.05)
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=10)
    assert not out.exists()
    resumed = run(finetune_command(client, boot, data, out))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from the checkpoint at step" in resumed.stderr
    model_id = adapter_file.load(tmp_path / "whole.safetensors").model_id
    a, b = adapter_file.load(out, model_id=model_id), adapter_file.load(tmp_path / "whole.safetensors")
    assert a.tensors.keys() == b.tensors.keys()
    assert max((a.tensors[k] - b.tensors[k]).abs().max().item() for k in a.tensors) <= 1e-6

    # PEFT's own loader takes the adapter (its directory form).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_dir = tmp_path / "peft"
    adapter_file.save(a, peft_dir, base_model="tiny")
    wrapped = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(worded_model)), str(peft_dir))
    assert sum("lora_" in n for n, _ in wrapped.named_parameters()) == len(a.tensors)
    assert torch.isfinite(wrapped(input_ids=torch.tensor([[1, 5, 9]])).logits).all()


def test_bad_data_is_refused_with_the_line_and_nothing_is_written(processes, worded_model, tmp_path):
    _, first = processes.node("a", worded_model, "0:4")
    boot = first["addrs"][0]
    client = tmp_path / "client"
    import_path(worded_model, client, alias="tiny")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "w5 w6", "response": "w7 w8"}\n{"prompt": "w5", "answer": "w9"}\n')
    began = time.monotonic()
    result = run(finetune_command(client, boot, data, tmp_path / "out.safetensors"), timeout=120)
    assert result.returncode == 2
    assert "error:" in result.stderr and "line 2" in result.stderr and "response" in result.stderr
    assert not (tmp_path / "out.safetensors").exists() and time.monotonic() - began < 120
    missing = run(finetune_command(client, boot, tmp_path / "nope.txt", tmp_path / "out.safetensors"))
    assert missing.returncode == 2 and "nope.txt" in missing.stderr
