"""The parent process: ``dtrain train``'s launcher, which runs no training itself. ``elastic``:
torch's elastic launch (signals forwarded, failure and preemption reports, whether this machine
hosts the rendezvous); ``agent``: torch's local agent with the workers' store port held until
the job ends; ``rendezvous_wait``: the launcher's side of a rendezvous across machines;
``rendezvous_host``: ``dtrain rendezvous``, the rendezvous served apart from the training
machines; ``inplace``: the launcher of ``fault.recovery = "inplace"`` (one agent per worker and
the membership coordinator, :mod:`dtrain.recovery`)."""
