"""The SQL registry: members, masters, jobs, job runs, savepoints, upgrade runs and the audit trail."""
