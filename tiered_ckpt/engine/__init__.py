"""A running job's background work: staging, the writer, uploads, restores, preemption."""
