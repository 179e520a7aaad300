"""SimPy discrete-event simulator of rlaxkit fleets (workers, staleness, preemption)."""
