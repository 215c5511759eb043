"""``dtrain rendezvous``: the rendezvous of a multi-machine job, run apart from the machines
that train.

Normally the machine started with ``--node-rank 0`` hosts the rendezvous inside its own
``dtrain train``: when that machine's launcher dies, the rendezvous dies with it and every other
machine ends ("lost the rendezvous host"). Run here instead -- on a login node, a scheduler
node, any machine that stays up -- the rendezvous outlives any training machine: with
``--max-restarts``, the others restart their workers and wait for the lost machine, and the
job resumes from its newest checkpoint as soon as ``dtrain train`` is started there again.
It is torch's own key-value store (the c10d rendezvous's backend), served until this command
is stopped.
"""

from __future__ import annotations

import datetime
import signal
import sys

from dtrain.errors import UserError


def serve(port: int) -> int:
    """Serve the rendezvous store on every address of this machine at ``port`` until SIGINT
    or SIGTERM; returns the exit code."""
    import torch.distributed as dist

    if not 0 < port < 65536:
        raise UserError(f"--port {port}: a TCP port, 1 to 65535")
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "0.0.0.0",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
    except (RuntimeError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot serve the rendezvous on port {port}: {first}") from None
    print(
        f"dtrain: rendezvous store listening on port {port}; start `dtrain train` on every "
        f"machine with --rdzv-endpoint THIS_MACHINE:{port} (Ctrl-C or SIGTERM stops it)",
        file=sys.stderr,
        flush=True,
    )
    stop = (signal.SIGINT, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    received = signal.sigwait(stop)
    del store  # closes the server
    print(f"dtrain: rendezvous store stopped ({signal.Signals(received).name})", file=sys.stderr)
    return 0
