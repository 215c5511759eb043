"""One job, one config: the ranks compare their configs as they start, before the model is built.

Every machine's launcher gives its workers its own config (its command line and files), so
two machines started with different values -- another ``optim.lr``, another seed -- would
otherwise train together, each with its own. The ranks exchange a digest of their configs (one
small collective); where the digests differ they exchange the configs themselves, and every
rank stops with the same one-line error naming the ranks, their hosts and the keys that differ.

What may differ between the machines of one job: :data:`PER_HOST`.
"""

from __future__ import annotations

import hashlib
import json
import socket
from typing import Any

import torch.distributed as dist

from dtrain.comm.plain import all_gather_json
from dtrain.config import Config
from dtrain.config.resume import flatten
from dtrain.dist.runtime import Runtime
from dtrain.errors import ConfigError

# Where each machine reaches the shared run folder (a shared disk may be mounted at another
# path on each) and each machine's own loader settings.
PER_HOST = ("run.dir", "run.local_dir", "data.num_workers", "data.prefetch")


def shared_part(cfg: Config) -> dict[str, Any]:
    """The keys every rank of a job must agree on, flattened (``optim.lr``: value)."""
    return {k: v for k, v in flatten(cfg.to_dict()).items() if k not in PER_HOST}


def digest(part: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(part, sort_keys=True, default=repr).encode()).hexdigest()


def agree_on_config(cfg: Config, runtime: Runtime) -> None:
    """Collective: raise :class:`ConfigError` on every rank when the ranks' configs differ."""
    if runtime.world_size == 1 or not dist.is_initialized():
        return
    mine = shared_part(cfg)
    digests = all_gather_json(digest(mine))
    if len(set(digests)) == 1:
        return
    # As JSON has them: a value JSON cannot hold (a TOML date in [task]) as its repr, which
    # is what the digest above saw of it.
    plain = json.loads(json.dumps(mine, default=repr))
    everyone = [(str(host), part) for host, part in all_gather_json([socket.gethostname(), plain])]
    raise ConfigError(describe_differences(everyone))


def describe_differences(everyone: list[tuple[str, dict[str, Any]]]) -> str:
    """The words for ranks whose configs differ from rank 0's (``everyone``: each rank's host
    and :func:`shared_part`)."""
    reference = everyone[0][1]
    groups: dict[str, list[int]] = {}
    for rank, (_host, part) in enumerate(everyone):
        groups.setdefault(digest(part), []).append(rank)
    parts = []
    for ranks in groups.values():
        if 0 in ranks:
            continue
        part = everyone[ranks[0]][1]
        keys = sorted(k for k in set(reference) | set(part) if reference.get(k) != part.get(k))
        shown = "; ".join(
            f"{k} = {part.get(k, '(unset)')!r} there, {reference.get(k, '(unset)')!r} on rank 0"
            for k in keys[:8]
        ) + (f"; ... {len(keys) - 8} more" if len(keys) > 8 else "")
        hosts = ", ".join(sorted({everyone[r][0] for r in ranks}))
        verb = "differs" if len(ranks) == 1 else "differ"
        parts.append(f"{_ranks(ranks)} ({hosts}) {verb} from rank 0 ({everyone[0][0]}): {shown}")
    return (
        f"the ranks of this job were started with different configs: {'; '.join(parts)}; "
        "start every machine of the job with the same config"
    )


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
