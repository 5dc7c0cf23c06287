"""Parallel state: process groups on a DeviceMesh, gradient buffers and finalisation (dispatcher: model/)."""
