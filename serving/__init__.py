"""Serving: the Ray Serve application (API ingress, vLLM replicas, prompt building, hot swap)."""
