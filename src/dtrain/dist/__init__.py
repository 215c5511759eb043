"""How a process joins the job: the job's secret, the stores it hosts (bound to the job's
address, never every address) and the values it signs there."""
