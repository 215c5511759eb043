"""How a batch's inputs reach the model: the one place every strategy's forward goes through.

``inputs`` that are a mapping (a dict batch, as Hugging Face models take it) are passed as
keyword arguments, ``model(**inputs)``; anything else as the one positional argument,
``model(inputs)``. The first time a model meets a set of keys, the keys are checked against
its ``forward``: a key it does not take, or an argument it needs that the batch lacks, is a
one-line error naming both (a model whose ``forward`` swallows ``**kwargs`` silently, as
Hugging Face's do, would otherwise train on a batch that never reached it).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from dtrain.errors import UserError

# (forward's function, the batch's keys) already checked: the check runs once per layout.
_checked: set[tuple[Any, frozenset[str]]] = set()


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        check_keywords(model, inputs)
        return model(**inputs)
    return model(inputs)


def check_keywords(model: nn.Module, inputs: Mapping[str, Any]) -> None:
    """Raise a :class:`UserError` when the batch's keys do not fit ``model.forward``."""
    inner = getattr(model, "module", None)  # the user's model inside DDP's wrapper
    target = inner if isinstance(inner, nn.Module) else model
    forward = getattr(type(target), "forward", None)
    key = (forward, frozenset(inputs))
    if key in _checked:
        return
    problem = keyword_mismatch(target, inputs)
    if problem:
        raise UserError(
            f"the batch's inputs {sorted(inputs)} do not fit {type(target).__name__}.forward: "
            f"{problem}; make the dataset's dict keys the model's argument names (the key "
            "'labels' or 'target' is taken out as the targets), or give Task.split_batch"
        )
    _checked.add(key)


def keyword_mismatch(model: nn.Module, inputs: Mapping[str, Any]) -> str:
    """What is wrong with calling ``model(**inputs)``, or '' when nothing is."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward that hides its signature: torch will say
        return ""
    params = signature.parameters.values()
    named = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    # Hugging Face models take **kwargs for options, never for batch fields, and ignore
    # what they do not know: their batch keys must be named arguments.
    strict = not takes_any or hasattr(model, "main_input_name")
    unknown = sorted(set(inputs) - named) if strict else []
    required = sorted(
        p.name
        for p in params
        if p.name in named and p.default is inspect.Parameter.empty and p.name not in inputs
    )
    problems = []
    if unknown:
        problems.append(f"it takes no argument {', '.join(map(repr, unknown))}")
    if required:
        problems.append(f"it needs {', '.join(map(repr, required))}")
    if not unknown and not required and not set(inputs) & named and named:
        problems.append(f"none of the keys is one of its arguments {sorted(named)}")
    main = getattr(model, "main_input_name", None)
    if (
        not problems
        and isinstance(main, str)
        and main in named
        and main not in inputs
        and "inputs_embeds" not in inputs
    ):
        problems.append(f"the batch has no {main!r}")
    return "; ".join(problems)
