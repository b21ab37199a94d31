"""Prometheus metrics: the API ingress's (`GET /metrics`) and the model replicas' (through Ray).

The ingress. Replicas report what they did in each result (summaries, truncation, the
engine's time to first token), and the ingress counts it here, so one scrape of the ingress
covers the request path. Producer buffer metrics live beside the producer
(feedback/producer.py) in the same registry. Completion latency, time to first token and
errors carry the served `version` and the `pool` (stable or canary), so a canary can be held
against stable in Prometheus.

The replicas. A Ray Serve replica is a Ray actor nobody scrapes, so what only a replica sees
(its hot swaps, vLLM's engine statistics) goes through Ray's metrics API, and Ray's metrics
agent on each node exports it in Prometheus's format, as Ray Serve exports its own metrics:
`ray.init(_metrics_export_port=...)` or `ray start --metrics-export-port`
(serve.ray_metrics_port), every name prefixed `ray_` and with ':' turned to '_'.
`ReplicaMetric` records there inside a Ray worker and in this process's registry elsewhere
(a benchmark, a test); vLLM's own logger for Ray (`RayPrometheusStatLogger`, the one Ray
Serve LLM uses) does the same for its metrics (serving/engine.py). `exported_names()` lists
every name either scrape can show, for the Grafana dashboard's test (ops/grafana/).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from prometheus_client import REGISTRY, Counter, Histogram

REQUESTS = Counter("flywheel_http_requests_total", "HTTP requests", ["route", "status"])
LATENCY = Histogram(
    "flywheel_http_request_seconds",
    "HTTP request latency",
    ["route"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
STAGE_LATENCY = Histogram(
    "flywheel_http_stage_seconds",
    "Where a request's time went, by stage (serving/http/timing.py; its Server-Timing header)",
    ["route", "stage"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
COMPLETIONS = Counter("flywheel_completions_total", "Completions served", ["version", "shape"])
TOKENS = Counter("flywheel_tokens_total", "Tokens processed", ["kind"])  # prompt | completion
EMPTY = Counter(
    "flywheel_empty_completions_total", "Completions with no suggestion (abstained, or withheld)", ["version"]
)
WITHHELD = Counter(
    "flywheel_withheld_suggestions_total",
    "Suggestions the confidence gate kept from the editor (model.min_confidence; learner/confidence.py)",
    ["version"],
)
# cached | generated: used in a prompt; skipped: older chunks left out (no room, or the per-request cap);
# deferred: not cached, queued to be written in the background (serve.summarize_in_background)
SUMMARIES = Counter("flywheel_summaries_total", "Self-summaries of prompt chunks", ["source"])
SUMMARY_FALLBACKS = Counter("flywheel_summary_fallbacks_total", "Prompts truncated because self-summarization failed")
TRUNCATED_TOKENS = Counter("flywheel_prompt_truncated_tokens_total", "Prompt tokens cut to fit the context budget")
ROUTES = Counter(
    "flywheel_routing_traces_total",
    "Completion records by their routing trace (router replay): carried, absent (dense model, capture off or failed), too_long",
    ["outcome"],
)
EVENTS = Counter("flywheel_events_total", "Feedback events accepted", ["type"])

# Per served version (and pool). `version` is an integer that grows with every published version
# (every few hours in production, every minute or two in the demo), so its series would grow
# without end in a long-lived ingress: `by_version` keeps those of the KEEP_VERSIONS versions
# observed most recently and drops the rest (a version no pool serves any more); so do
# COMPLETIONS and EMPTY above. `pool` is stable or canary; `reason` one of ERROR_REASONS. At
# most KEEP_VERSIONS x 2 pools x buckets series per histogram.
KEEP_VERSIONS = 8
ERROR_REASONS = ("replica_failed", "busy", "stream_failed")
_SECONDS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60)
COMPLETION_LATENCY = Histogram(
    "flywheel_completion_seconds",
    "Completion requests answered, from the request's arrival at the ingress to its last byte",
    ["version", "pool"],
    buckets=_SECONDS,
)
FIRST_TOKEN = Histogram(
    "flywheel_completion_first_token_seconds",
    "From a replica receiving a completion request to the engine's first token (prompt building included)",
    ["version", "pool"],
    buckets=_SECONDS,
)
COMPLETION_ERRORS = Counter(
    "flywheel_completion_errors_total",
    "Completion requests the replica pool failed (503, or an error event in a stream)",
    ["version", "pool", "reason"],
)


class _RecentVersions:
    """The label sets of the per-version metrics, by version, for the KEEP_VERSIONS versions
    observed most recently; older versions' series are removed from their metrics."""

    def __init__(self, keep: int):
        self.keep = keep
        self._seen: OrderedDict[str, set[tuple]] = OrderedDict()
        self._lock = threading.Lock()

    def labels(self, metric, version: str, *rest: str):
        with self._lock:
            self._seen.setdefault(version, set()).add((metric, rest))
            self._seen.move_to_end(version)
            while len(self._seen) > self.keep:
                old, series = self._seen.popitem(last=False)
                for m, r in series:
                    m.remove(old, *r)
        return metric.labels(version, *rest)


by_version = _RecentVersions(KEEP_VERSIONS).labels
"""`by_version(METRIC, version, pool, ...)`: the metric's child for those labels (see above)."""


REPLICA_METRICS: list[ReplicaMetric] = []  # every one declared, for exported_names()


class ReplicaMetric:
    """A counter or histogram recorded in a model replica's process: through Ray's metrics agent
    inside a Ray worker (the module docstring says why), else in this process's registry. The
    backend is chosen on first use, so importing a module that declares one never starts Ray."""

    def __init__(self, kind: str, name: str, doc: str, labels: tuple[str, ...] = (), buckets=None):
        assert kind in ("counter", "histogram"), kind
        self.kind, self.name, self.doc, self.labelnames, self.buckets = kind, name, doc, labels, buckets
        self._ray = None
        self._local = None
        REPLICA_METRICS.append(self)

    def inc(self, value: float = 1.0, **labels: str) -> None:
        if self._backend() == "ray":
            self._ray.inc(value, tags=labels)
        else:
            self._child(labels).inc(value)

    def observe(self, value: float, **labels: str) -> None:
        if self._backend() == "ray":
            self._ray.observe(value, tags=labels)
        else:
            self._child(labels).observe(value)

    def exported_names(self) -> list[str]:
        """The sample names Ray's agent exports it as (`ray_` prefix; a counter's `_total`)."""
        return _sample_names(f"ray_{self.name}", self.kind)

    def _child(self, labels: dict):
        return self._local.labels(**labels) if self.labelnames else self._local

    def _backend(self) -> str:
        if self._ray is None and self._local is None:
            import ray

            if ray.is_initialized():
                from ray.util import metrics as ray_metrics

                if self.kind == "counter":
                    self._ray = ray_metrics.Counter(self.name, self.doc, tag_keys=self.labelnames)
                else:
                    self._ray = ray_metrics.Histogram(
                        self.name, self.doc, boundaries=list(self.buckets), tag_keys=self.labelnames
                    )
            elif self.kind == "counter":
                self._local = Counter(self.name, self.doc, list(self.labelnames))
            else:
                self._local = Histogram(self.name, self.doc, list(self.labelnames), buckets=self.buckets)
        return "ray" if self._ray is not None else "local"


# vLLM's metrics that Flywheel turns on (serve.engine.log_stats; docs.vllm.ai, "Production
# Metrics"), by kind, as vLLM names them. Through Ray they are exported as `ray_vllm_<name>`.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


def _sample_names(name: str, kind: str) -> list[str]:
    if kind == "counter":
        return [name if name.endswith("_total") else f"{name}_total"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
    return [name]


def exported_names() -> set[str]:
    """Every sample name a scrape of Flywheel can show: this process's registry (import the
    modules that declare metrics first), the replicas' metrics and vLLM's through Ray."""
    names = {s.name for m in REGISTRY.collect() for s in m.samples}
    # A labelled metric shows no samples before its first use: its declared names count too.
    for m in REGISTRY.collect():
        names.update(_sample_names(m.name, m.type))
    for rm in REPLICA_METRICS:
        names.update(rm.exported_names())
    for name, kind in VLLM_METRICS.items():
        names.update(_sample_names("ray_" + name.replace(":", "_"), kind))
    return names
