"""Ownership of a job between its runs, shared by the drivers and the control plane: the parked run's lease
(`lease`) and the fence every write passes (`fence`)."""
