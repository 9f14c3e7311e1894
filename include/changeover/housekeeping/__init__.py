"""Housekeeping: the leak checker (`leaks`), which finds what the registry and the cluster disagree on and cleans
it after a grace period."""
