"""A loop of the user's own with further models under tensor parallelism (``run.wrap``;
docs/own-loop.md), importable by worker processes: the tiny test GPT (cut by its plan) teaches
a smaller GPT (a further model with a plan: cut too) and a probe (a linear map, no plan: whole
on every rank), each with its own optimizer, and a frozen copy of the teacher's first state
(built differently on each rank: rank 0's is taken) anchors the main model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.train.job import build_job_config
from tests.dist_helpers import params_of
from tests.tasks import tiny_gpt

VOCAB = 64


def _sgd(params: list[tuple[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in params], lr=0.2)


def _per_token_kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of each position's next-token distribution."""
    goal = F.log_softmax(teacher, dim=-1)
    return (goal.exp() * (goal - F.log_softmax(student, dim=-1))).sum(-1).reshape(-1)


def distill_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The loop trained as this rank of the job: every model's parameters, gathered whole on
    rank 0 (further models under ``<name>.``), and the frozen model's first value here."""
    from torch.distributed.tensor import DTensor

    seen: dict[str, Any] = {}

    def loop(run: dtrain.Run) -> None:
        task = tiny_gpt(run.config)
        opts = run.config.task
        model, _ = run.prepare(task.model, task.train_data, collate_fn=task.collate_fn)
        small = GPTConfig(vocab_size=VOCAB, seq_len=opts.seq_len, n_layer=1, n_head=2, d_model=16)
        student, student_optimizer = run.wrap("student", GPT(small), optimizer=_sgd)
        probe, probe_optimizer = run.wrap("probe", nn.Linear(VOCAB, 1), optimizer=_sgd)
        torch.manual_seed(run.rank)  # a different anchor on each rank: rank 0's is kept
        anchor, _ = run.wrap("anchor", nn.Linear(VOCAB, VOCAB))
        seen["anchor"] = anchor.weight.detach().cpu().numpy().copy()
        seen["cut"] = {
            name: sorted(n for n, p in module.named_parameters() if isinstance(p, DTensor))
            for name, module in (("student", student), ("probe", probe))
        }
        assert student_optimizer is not None and probe_optimizer is not None
        for batch in run.batches():
            for inputs, _targets in batch:  # the student learns the teacher's distributions
                with torch.no_grad():
                    teacher = model(inputs)
                run.backward(_per_token_kl(teacher, student(inputs)))
            run.update(student_optimizer)
            for inputs, targets in batch:  # the probe reads each next token's id off them
                with torch.no_grad():
                    probs = model(inputs).softmax(-1)
                guess = probe(probs).squeeze(-1)
                run.backward((guess - targets.float() / VOCAB).square().reshape(-1))
            run.update(probe_optimizer)
            for inputs, targets in batch:  # the teacher: its task, near the anchor's logits
                logits = model(inputs)
                losses = task.loss_fn(logits, targets)
                pull = (logits - anchor(F.one_hot(inputs, VOCAB).float())).square().mean(-1)
                run.backward(losses + 0.01 * pull.reshape(-1))
            run.step()

    run = dtrain.Run.join(build_job_config(raw))
    run.train(loop)
    params = params_of(run.trainer)
    for name in ("student", "probe"):
        state = run._wrapped[name].strategy.model_state_dict()  # collective
        params.update({f"{name}.{k}": v.detach().cpu().numpy().copy() for k, v in state.items()})
    return {"params": params, **seen}
