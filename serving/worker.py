"""What Flywheel adds to vLLM's worker (engine argument `worker_extension_cls`): in-place weight
swaps (serving/hotswap.py) and route capture (serving/routes.py). Runs in the worker process."""

from __future__ import annotations

from serving.hotswap import WeightSwapExtension
from serving.routes import RouteCapture


class WorkerExtension(WeightSwapExtension, RouteCapture):
    def flywheel_load_weights(self, path: str, sha256: str) -> dict:
        result = super().flywheel_load_weights(path, sha256)
        self.flywheel_clear_routes()  # routes kept by prefix content belong to the old weights
        return result
