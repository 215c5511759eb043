"""Hugging Face tasks and helpers for the tests of dtrain.hf, export and init_from: importable
by worker processes (``tests.hf_helpers:...``); they need ``transformers``."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from examples import hf_bert, hf_gpt2

from dtrain.config import Config
from dtrain.errors import UserError
from dtrain.task import Task, task_config
from tests.dist_helpers import make_trainer, params_of

# Small models: a few seconds for every strategy's run of 10 steps.
GPT2_TASK = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab": 64,
    "seq_len": 16,
    "train_size": 128,
    "val_size": 16,
    "generate_tokens": 0,
}
BERT_TASK = {
    "layers": 2,
    "hidden": 32,
    "heads": 2,
    "vocab": 64,
    "seq_len": 16,
    "train_size": 128,
    "val_size": 16,
}
BATCH = 8
OWN_LOOP_HF = Path(hf_gpt2.__file__).parent / "own_loop_hf.py"


def hf_raw(run_dir: Path, model: str, **sections: dict[str, Any]) -> dict[str, Any]:
    """A config training an example's model with plain SGD (an update linear in the
    gradient), a constant rate and the stored data order: a single-process loop of a few
    lines repeats it exactly."""
    raw: dict[str, dict[str, Any]] = {
        "run": {"dir": str(run_dir), "task": f"examples.hf_{model}:build", "seed": 0},
        "data": {"global_batch_size": BATCH, "prefetch": 0, "shuffle": "none"},
        "train": {"steps": 10, "log_every": 1, "grad_clip": 0.0},
        "optim": {
            "name": "sgd",
            "lr": 0.1,
            "warmup_steps": 0,
            "min_lr_ratio": 1.0,
            "weight_decay": 0.0,
        },
        "eval": {"every": 0, "batch_size": BATCH},
        "checkpoint": {"every": 0},
        "task": dict(GPT2_TASK if model == "gpt2" else BERT_TASK),
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def logged_losses(run_dir: str | Path) -> list[float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]


def logged_val_loss(run_dir: str | Path) -> float:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["val_loss"] for r in map(json.loads, lines) if r.get("kind") == "eval"][-1]


def train_each(raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train every config in turn in this one launch: the logged losses, or the user error
    a run stopped with (and the step it stopped at)."""
    import time

    out: list[dict[str, Any]] = []
    for raw in raws:
        started = time.perf_counter()
        trainer = None
        hook: dict[str, Any] = {}
        try:
            if raw["run"].get("script"):  # a loop of the user's own: its logged losses
                train_script(raw)
                seconds = time.perf_counter() - started
                out.append({"losses": logged_losses(raw["run"]["dir"]), "seconds": seconds})
                continue
            trainer = make_trainer(raw)
            if trainer.task.after_training is not None:
                trainer.task.after_training = probe_after_training(
                    trainer.task.after_training, Path(raw["run"]["dir"]), hook
                )
            summary = trainer.fit()
        except UserError as exc:
            out.append({"error": str(exc), "step": None if trainer is None else trainer.step})
            continue
        result: dict[str, Any] = {"losses": logged_losses(raw["run"]["dir"])}
        result["val_loss"] = summary.val_loss
        result["generated"] = summary.generated
        result["seconds"] = time.perf_counter() - started
        result["hook"] = hook
        if "lora_r" in raw["task"]:  # LoRA: the trained model's logits (tests/test_peft.py)
            from tests.peft_helpers import probe

            result.update(probe(trainer))
        if raw.get("strategy", {}).get("name") == "tensor":
            result["params"] = params_of(trainer)
        out.append(result)
    return out


def train_script(raw: dict[str, Any]) -> None:
    """``run.script``'s ``main(run)`` trained as this rank of the job."""
    import dtrain
    from dtrain.loop.script import load_main
    from dtrain.train.job import build_job_config

    dtrain.Run.join(build_job_config(raw)).train(load_main(raw["run"]["script"]))


PIPELINE = {"name": "pipeline", "pipeline_stages": 2, "pipeline_schedule": "gpipe"}
TENSOR = {"name": "tensor", "tensor_parallel": 2}
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "allreduce": {"name": "allreduce"},
    "fsdp": {"name": "fsdp"},
    "pipeline": PIPELINE,
}


def hf_run_configs(root: Path) -> dict[str, dict[str, Any]]:
    """Every Hugging Face run the tests read, in the order one launch trains them: GPT-2 and
    BERT under each strategy and tensor (10 steps, evaluated and saved at the end; BERT has
    no tensor plan), GPT-2 in examples/own_loop_hf.py's loop under ddp, fsdp and tensor, a
    run starting from the tensor run's weights under ddp, a loss written as
    Hugging Face shifts it with the default count, a run starting from the fsdp GPT-2's
    weights and one whose model has another shape."""
    raws: dict[str, dict[str, Any]] = {}
    for model in ("gpt2", "bert"):
        for name, strategy in STRATEGIES.items():
            micro = {"micro_batches": 2} if name == "pipeline" else {}
            raws[f"{model}-{name}"] = hf_raw(
                root / f"{model}-{name}", model, strategy=strategy, data=micro
            )
    # Tensor parallelism: GPT-2 has a plan (its fused attention cut by head), BERT none.
    for model in ("gpt2", "bert"):
        raws[f"{model}-tensor"] = hf_raw(root / f"{model}-tensor", model, strategy=TENSOR)
    # Stopped at step 5 and resumed to 10: the fused attention's state read back as it was.
    for name, steps in (("tensor-half", 5), ("tensor-resumed", 10)):
        raws[name] = hf_raw(root / "tensor-half", "gpt2", strategy=TENSOR, train={"steps": steps})
    for name in ("ddp", "fsdp", "tensor"):  # examples/own_loop_hf.py: the job in a loop of its own
        own = {"script": str(OWN_LOOP_HF)}
        strategy = TENSOR if name == "tensor" else {"name": name}
        raws[f"gpt2-own-{name}"] = hf_raw(
            root / f"gpt2-own-{name}", "gpt2", run=own, strategy=strategy
        )
    shifted = hf_raw(root / "shifted", "gpt2", strategy={"name": "ddp"})
    shifted["run"]["task"] = "tests.hf_helpers:gpt2_user_shifted_loss"
    raws["shifted"] = shifted
    init = {"init_from": str(root / "gpt2-fsdp")}
    raws["init"] = hf_raw(root / "init", "gpt2", run=init, train={"steps": 2})
    raws["bad-init"] = hf_raw(root / "bad-init", "gpt2", run=init, task={"n_embd": 16})
    # The tensor-parallel run's checkpoint, in GPT-2's own layout, read under ddp.
    from_tensor = {"init_from": str(root / "gpt2-tensor")}
    raws["init-tensor"] = hf_raw(root / "init-tensor", "gpt2", run=from_tensor, train={"steps": 2})
    if importlib.util.find_spec("peft") is not None:  # LoRA (tests/test_peft.py)
        from tests.peft_helpers import lora_run_configs

        raws.update(lora_run_configs(root))
    return raws


def train_hf_runs(root: Path) -> dict[str, dict[str, Any]]:
    """:func:`hf_run_configs`, trained on 2 ranks in one launch (each rank imports
    transformers once); rank 0's results by name."""
    from tests.ranks import run_ranks

    if importlib.util.find_spec("peft") is not None:
        from tests.peft_helpers import prepare_lora_runs

        prepare_lora_runs(root)
    raws = hf_run_configs(root)
    ranks = run_ranks(train_each, 2, list(raws.values()), timeout=280)
    results = dict(zip(raws, ranks[0]))
    for index, name in enumerate(raws):
        # The ranks the after-training hook ran on.
        results[name]["hook_ranks"] = [r for r, mine in enumerate(ranks) if mine[index].get("hook")]
    return results


def probe_after_training(hook: Any, run_dir: Path, seen: dict[str, Any]) -> Any:
    """``hook``, noting whether it ran here and on what (DTensor parameters are a sharded
    model), after saving the model it got with its own ``save_pretrained`` (which fails on a
    sharded model)."""
    from torch.distributed.tensor import DTensor

    def probe(model: Any) -> str:
        seen["sharded"] = any(isinstance(p, DTensor) for p in model.parameters())
        model.save_pretrained(str(run_dir / "after-training"))
        seen["saved"] = (run_dir / "after-training" / "config.json").exists()
        return str(hook(model))

    return probe


def gpt2_batches(steps: int) -> list[torch.Tensor]:
    opts = hf_gpt2.GPT2Options(**GPT2_TASK)  # type: ignore[arg-type]
    data = hf_gpt2.PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0)
    return [data.ids[s * BATCH : (s + 1) * BATCH] for s in range(steps)]


@functools.cache  # several tests compare with the same loop: it runs once per process
def one_process_losses(model_kind: str, steps: int = 10, lr: float = 0.1) -> tuple[float, ...]:
    """The hand-written single-process loop: the model's own (mean) loss from its own labels
    -- Hugging Face's convention, shifted inside the model for GPT-2 -- and torch's SGD."""
    from dtrain.checkpoint.rng import seed_everything

    seed_everything(0)  # as dtrain seeds before the task builds its model
    if model_kind == "gpt2":
        model = hf_gpt2.build_model(hf_gpt2.GPT2Options(**GPT2_TASK))  # type: ignore[arg-type]
        batches = [{"input_ids": ids, "labels": ids} for ids in gpt2_batches(steps)]
    else:
        opts = hf_bert.BertOptions(**BERT_TASK)  # type: ignore[arg-type]
        model = hf_bert.build_model(opts)
        data = hf_bert.PatternClasses(opts.train_size, opts.seq_len, opts.vocab, opts.classes, 0)
        batches = [
            {
                "input_ids": data.ids[s * BATCH : (s + 1) * BATCH],
                "labels": data.labels[s * BATCH : (s + 1) * BATCH],
            }
            for s in range(steps)
        ]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tuple(losses)


@dataclass
class UserShiftedOptions(hf_gpt2.GPT2Options):
    pass


@task_config(UserShiftedOptions)
def gpt2_user_shifted_loss(cfg: Config) -> Task:
    """An HF GPT-2 with a loss written as Hugging Face shifts it, and the default count (every
    label): the 'wrong math' of one position per sequence too many in the count."""
    opts = cfg.task

    def shifted(output: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = output.logits[:, :-1]
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), reduction="none"
        )

    data = hf_gpt2.PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0)
    return Task(
        model=hf_gpt2.build_model(opts),
        train_data=[{"input_ids": ids, "labels": ids} for ids in data.ids],
        loss_fn=shifted,
    )


def tp_plan_losses(kinds: list[str]) -> list[dict[str, Any]]:
    """:func:`tp_plan_run` of each kind, in one launch."""
    return [tp_plan_run(kind) for kind in kinds]


def tp_plan_run(kind: str) -> dict[str, Any]:
    """A tiny ``transformers`` model of ``kind`` ("llama", "qwen2") cut over every rank by
    the plan its config carries (``base_model_tp_plan``, read by dtrain) beside the same model
    whole, 3 SGD steps each on one batch: both models' losses and the names cut."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from dtrain.parallel.tensor_plan import model_plan

    names = {"llama": "Llama", "qwen2": "Qwen2"}[kind]
    config = getattr(transformers, f"{names}Config")(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    build = getattr(transformers, f"{names}ForCausalLM")
    torch.manual_seed(0)
    whole = build(config)
    torch.manual_seed(0)
    cut = build(config)
    plan = model_plan(cut, torch.distributed.get_world_size())
    parallelize_module(cut, init_device_mesh("cpu", (torch.distributed.get_world_size(),)), plan)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {"cut": sorted(plan), "whole": [], "tensor": []}
    for name, model in (("whole", whole), ("tensor", cut)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            out[name].append(float(loss.detach()))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return out
