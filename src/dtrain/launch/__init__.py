"""The parent process: ``dtrain train``'s launcher, which runs no training itself. ``launcher``:
the one launcher, whose recovery mode chooses who supervises the workers (torch's elastic agent,
one per machine; or the launcher itself, beside the membership coordinator of
:mod:`dtrain.recovery`);
``options``: the machines and workers asked for, and where this machine stands; ``reports``:
what the launcher says and the exit codes; ``agent``: torch's local agent with the workers'
store port held until the job ends; ``rendezvous_wait``: the launcher's side of a rendezvous
across machines; ``rendezvous_host``: ``dtrain rendezvous``, the rendezvous served apart from
the training machines."""
