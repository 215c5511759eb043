"""How a process joins the job, in every process of it: process group, network, the start-up
check, the job's store and secret.

How a process joins the job: its process group, device and threads from the launcher's
environment (``runtime``), this machine's addresses and interfaces (``network``), the start-up
check that the job's store and the peers are reached (``reachability``), the job's secret, the
stores it hosts (bound to the job's address, never every address) and the values it signs
there."""
