"""Checkpoint sources and sinks: DeepSpeed, universal, and restore into a live engine."""
