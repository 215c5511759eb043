"""Opt-in extensions: features off the core path, each imported only when a run's config asks
for it by name.

``TRANSPORTS``: the values of ``comm.transport`` besides ``'backend'``, each mapped to the
module that carries a comm hook's sums that way (the seam: :mod:`dtrain.comm.transport`).
"""

TRANSPORTS: dict[str, str] = {
    "shm": "dtrain.ext.shm",  # a shared-memory segment between the ranks of one machine
    "auto": "dtrain.ext.shm",  # shm where it can be used, else the backend
}
