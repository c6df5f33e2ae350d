"""Coordination across rank processes, replicated arrays, N -> M resharding."""
