"""Prometheus metrics of one service (its own registry, so several services can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 20.0, 40.0, 80.0)
_STEP = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "g4rt_"
        self.requests = Counter(p + "http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.finished = Counter(p + "request_finished", "engine requests finished, by reason", ["reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between a request's token deliveries",
                             buckets=_STEP, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "arrival to last token", buckets=_LATENCY, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds", "arrival to first scheduled", buckets=_LATENCY,
                               registry=r)
        self.step = Histogram(p + "step_seconds", "one engine step", buckets=_STEP, registry=r)
        self.running = Gauge(p + "num_requests_running", "requests in the running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "requests queued for admission", registry=r)
        self.frames = Gauge(p + "kv_frames", "KV arena frames by cache group and state", ["group", "state"], registry=r)
        self.compiles = Counter(p + "compiles_after_ready", "kernels and graphs compiled after warm-up (each one a "
                                "stall of the step that compiled it)", registry=r)
        self.ready = Gauge(p + "ready", "1 once warm-up is done and the service accepts requests", registry=r)
        ProcessCollector(registry=r)  # the API process's process_cpu_seconds_total, memory, open fds (Linux)

    def render(self) -> bytes:
        return generate_latest(self.registry)
