"""Faults under every recovery mode: each rank's liveness record, the watchdog and its
diagnosis of a failed peer, preemption, the run's status, error logs, the sample-id audit and
the failpoints tests inject. What only ``fault.recovery = "inplace"`` uses is
:mod:`dtrain.recovery`."""
