"""How a process joins the job, in every process of it: process group, network, the start-up
check, the job's store and secret.

``runtime`` (process group, device and threads from the launcher's environment), ``network``
(this machine's addresses and interfaces), ``reachability`` (the start-up check), the job's
secret, the stores it hosts (bound to the job's address, never every address) and the values it
signs there."""
