"""Parallel state: DeviceMesh and process groups, the token dispatcher, gradient buffers and finalisation."""
