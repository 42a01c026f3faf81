"""What the fine-tuning tests share: a LoRA adapter with every factor non-zero,
microbatches of random tokens, PEFT's gradients in one process, a SwarmTrainer over a
consumer, and the differences between two sets of gradients."""

import torch
from peft import LoraConfig, get_peft_model

from compushare.model.arch import load_config
from compushare.model.lora import Adapter, LoraSpec
from compushare.model.train_head import IGNORE
from compushare.model.training_state import OptimizerSettings, TrainingState
from compushare.pipeline.client.planner import SwarmPlanner
from compushare.pipeline.client.swarm_trainer import SwarmTrainer
from helpers import reference_model

SPEC = LoraSpec(4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def adapter_for(model_dir, model_id: str) -> Adapter:
    config = load_config(model_dir)
    adapter = Adapter.initialised(SPEC, config, range(config.num_hidden_layers), seed=3, model_id=model_id)
    generator = torch.Generator().manual_seed(4)
    for name, tensor in adapter.tensors.items():
        if ".lora_B." in name:  # not zero: every factor gets a gradient
            tensor.normal_(0, 0.05, generator=generator)
    return adapter


def microbatches(vocab: int, count: int = 2, rows: int = 2, length: int = 12):
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (rows, length), generator=generator)
        labels = torch.full_like(ids, IGNORE)
        labels[:, :-1] = ids[:, 1:]
        labels[1, 8:] = IGNORE  # a shorter second row: padding counts in no loss
        out.append((ids, labels))
    return out


def peft_gradients(model_dir, adapter: Adapter, batches, base=None) -> tuple[float, dict[str, torch.Tensor]]:
    """The same loss and gradients in one process: transformers' model (or `base`) with PEFT's LoRA."""
    base = reference_model(model_dir) if base is None else base
    model = get_peft_model(base, LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, target_modules=list(SPEC.targets),
                                            lora_dropout=0.0))
    model.load_state_dict({"base_model.model." + k.replace(".weight", ".default.weight"): v
                           for k, v in adapter.tensors.items()}, strict=False)
    total = sum(int((labels != IGNORE).sum()) for _, labels in batches)
    named = {n.replace("base_model.model.", "").replace(".default", ""): p for n, p in model.named_parameters()
             if "lora_" in n}
    loss = 0.0
    for ids, labels in batches:
        logits = model(input_ids=ids).logits
        part = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=IGNORE, reduction="sum") / total
        part.backward()
        loss += part.item()
    return loss, {name: p.grad.clone() for name, p in named.items()}


async def trainer_for(consumer, **kwargs) -> SwarmTrainer:
    model = consumer.model
    planner = SwarmPlanner(consumer.host, consumer.dht, model.model_id, model.num_blocks,
                           penalties=consumer.penalties, view=consumer.view, karma=consumer.karma,
                           fmt=model.format.label)
    state = TrainingState(adapter_for(model.path, model.model_id), OptimizerSettings(lr=1e-3))
    trainer = SwarmTrainer(consumer.host, planner, model.model_id, consumer.head, state,
                           on_report=consumer._keep_report, **kwargs)
    await trainer.open()
    return trainer


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def per_projection(a: dict, b: dict) -> dict[str, float]:
    """The largest relative difference of `a` from `b` over each projection's factors."""
    out: dict[str, float] = {}
    for name in b:
        projection = name.split(".")[-3]  # ...layers.N.self_attn.q_proj.lora_A.weight
        error = ((a[name] - b[name]).abs().max() / b[name].abs().max().clamp_min(1e-12)).item()
        out[projection] = max(out.get(projection, 0.0), error)
    return out


def norm_per_projection(a: dict, b: dict) -> dict[str, float]:
    """||a - b|| / ||b|| over all of each projection's factors (every layer's A and B)."""
    errors: dict[str, float] = {}
    totals: dict[str, float] = {}
    for name in b:
        projection = name.split(".")[-3]
        errors[projection] = errors.get(projection, 0.0) + float((a[name] - b[name]).pow(2).sum())
        totals[projection] = totals.get(projection, 0.0) + float(b[name].pow(2).sum())
    return {k: (errors[k] / max(totals[k], 1e-30)) ** 0.5 for k in errors}
