"""Serving over HTTP: the OpenAI-compatible server, its assembly from flags, tensor-parallel serving and
replicas on Ray Serve."""
