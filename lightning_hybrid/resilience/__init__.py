"""Keeping long runs alive: a stuck rank named, replicas that drifted apart caught."""
