"""Prometheus metrics of the API ingress (`GET /metrics`).

Replicas report what they did in each result (summaries, truncation), and the ingress
counts it here, so one scrape of the ingress covers the whole request path. Producer
buffer metrics live beside the producer (feedback/producer.py) in the same registry.
"""

from prometheus_client import Counter, Histogram

REQUESTS = Counter("flywheel_http_requests_total", "HTTP requests", ["route", "status"])
LATENCY = Histogram(
    "flywheel_http_request_seconds",
    "HTTP request latency",
    ["route"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
COMPLETIONS = Counter("flywheel_completions_total", "Completions served", ["version", "shape"])
TOKENS = Counter("flywheel_tokens_total", "Tokens processed", ["kind"])  # prompt | completion
EMPTY = Counter("flywheel_empty_completions_total", "Completions with no suggestion (abstained)", ["version"])
# cached | generated: used in a prompt; skipped: older chunks left out (no room, or the per-request cap)
SUMMARIES = Counter("flywheel_summaries_total", "Self-summaries of prompt chunks", ["source"])
SUMMARY_FALLBACKS = Counter("flywheel_summary_fallbacks_total", "Prompts truncated because self-summarization failed")
TRUNCATED_TOKENS = Counter("flywheel_prompt_truncated_tokens_total", "Prompt tokens cut to fit the context budget")
EVENTS = Counter("flywheel_events_total", "Feedback events accepted", ["type"])
