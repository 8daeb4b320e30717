"""Prometheus metrics of one server (`GET /metrics`). Metric names are interface: add, never rename.

Each app owns its `CollectorRegistry` (not prometheus-client's global one), so tests and embedders can
build several apps in one process. Engine gauges and counters (a text engine's prefix cache:
`jaxstream_prefix_cache_queries_total` and `jaxstream_prefix_cache_hits_total`, tokens, vLLM's
`prefix_cache_queries` / `prefix_cache_hits`) are read from `engine.metrics()` at scrape time; engine
tick durations are copied into a histogram by `observe_ticks`, called at every scrape and once a second by
the app (the engine keeps only its latest tick durations, so a slow scraper alone would miss some).
"""
import typing

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Latencies of a realtime stream: first delta ~ delay + compute, finalisation ~ delay + flush.
_LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
_TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 5400, 7200)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        # First: a scrape collects in registration order, and this collector updates the tick histogram.
        r.register(_EngineCollector(self))
        self.connections = Gauge("jaxstream_ws_connections", "Open WebSocket connections", ["route"], registry=r)
        self.connections_opened = Counter("jaxstream_ws_connections_opened", "WebSocket connections accepted",
                                          ["route"], registry=r)
        self.connection_duration = Histogram("jaxstream_ws_connection_duration_seconds",
                                             "Lifetime of WebSocket connections", ["route"],
                                             buckets=_DURATION_BUCKETS, registry=r)
        self.connections_closed = Counter("jaxstream_ws_connections_closed", "WebSocket connections closed, "
                                          "by outcome", ["route", "outcome"], registry=r)
        self.sse_slow_readers = Counter("jaxstream_sse_slow_readers", "SSE streams whose client read nothing for "
                                        "send_timeout_s, dropped (the WebSocket routes count theirs as "
                                        "connections closed with outcome slow_reader)", ["route"], registry=r)
        self.requests_waiting = Gauge("jaxstream_http_requests_waiting", "One-shot HTTP requests (uploads, "
                                      "completions, chats) waiting for the server's room: a connection slot, or an "
                                      "upload's engine session", registry=r)
        self.errors = Counter("jaxstream_errors", "Protocol error events sent, by code", ["code"], registry=r)
        # Apart from jaxstream_errors, which operators alert on: a scanner probing URLs is not the server failing.
        self.routing_errors = Counter("jaxstream_http_routing_errors", "Requests no route took, by status and code: "
                                      "an unknown path (404), a method its route does not take (405), a WebSocket "
                                      "route asked without an upgrade (426)", ["status", "code"], registry=r)
        self.utterances = Counter("jaxstream_utterances", "Utterances (engine transcription sessions) ended, "
                                  "by outcome", ["outcome"], registry=r)
        self.audio_seconds = Counter("jaxstream_audio_seconds", "Seconds of audio received", registry=r)
        self.first_delta = Histogram("jaxstream_first_delta_seconds", "Time from an utterance's first audio to "
                                     "its first text delta", buckets=_LATENCY_BUCKETS, registry=r)
        self.finalize = Histogram("jaxstream_finalize_seconds", "Time from the final commit to "
                                  "transcription.done", buckets=_LATENCY_BUCKETS, registry=r)
        self.tick = Histogram("jaxstream_tick_seconds", "Duration of engine ticks", buckets=_TICK_BUCKETS,
                              registry=r)
        self._engine = None
        self._last_tick = 0

    def slow_reader_counter(self, request) -> "typing.Callable[[], None]":
        """`sse.stream_log`'s `on_slow_reader` for `request`: counted under its route's pattern (a Mode B session's
        events route has one label, not one per session)."""
        return self.sse_slow_readers.labels(route=request.match_info.route.resource.canonical).inc

    def attach_engine(self, engine) -> None:
        self._engine = engine
        self._last_tick = engine.metrics().ticks  # ticks of the warm-up are not serving latency

    def observe_ticks(self, snapshot=None) -> None:
        """Copies the tick durations the engine ran since the last call into the tick histogram."""
        if self._engine is None:
            return
        snapshot = snapshot or self._engine.metrics()
        new = snapshot.ticks - self._last_tick
        if new > 0:
            for seconds in snapshot.recent_tick_seconds[-new:]:
                self.tick.observe(seconds)
        self._last_tick = snapshot.ticks


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    _NAMES = ("jaxstream_engine_sessions", "jaxstream_engine_waiting", "jaxstream_engine_running",
              "jaxstream_engine_parked", "jaxstream_engine_evicted", "jaxstream_engine_max_sessions",
              "jaxstream_engine_healthy", "jaxstream_kv_pages_used", "jaxstream_kv_pages_total")
    _COUNTERS = ("jaxstream_prefix_cache_queries", "jaxstream_prefix_cache_hits")  # exposed with _total

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def describe(self):
        # Without describe() the registry would call collect() at registration, before any engine exists.
        return ([GaugeMetricFamily(name, name) for name in self._NAMES]
                + [CounterMetricFamily(name, name) for name in self._COUNTERS])

    def collect(self):
        engine = self._metrics._engine  # noqa: SLF001 - the collector is part of ServerMetrics
        if engine is None:
            return
        m = engine.metrics()
        self._metrics.observe_ticks(m)
        for name, help_text, value in (
                ("jaxstream_engine_sessions", "Transcription sessions the engine holds (running, parked or "
                 "evicted)", m.sessions),
                ("jaxstream_engine_waiting", "Sessions waiting for a device slot or pages", m.waiting),
                ("jaxstream_engine_running", "Sessions running on the device", m.running),
                ("jaxstream_engine_parked", "Sessions parked on the device waiting for audio", m.parked),
                ("jaxstream_engine_evicted", "Sessions evicted to host memory", m.evicted),
                ("jaxstream_engine_max_sessions", "Sessions the engine admits", m.max_sessions),
                ("jaxstream_engine_healthy", "1 while the engine thread runs", int(bool(engine.healthy)))):
            yield GaugeMetricFamily(name, help_text, value=value)
        for name, help_text, pools in (("jaxstream_kv_pages_used", "KV-cache pages in use", m.pages_used),
                                       ("jaxstream_kv_pages_total", "KV-cache pages", m.pages_total)):
            family = GaugeMetricFamily(name, help_text, labels=["pool"])
            for pool, value in sorted(pools.items()):
                family.add_metric([pool], value)
            yield family
        for name, help_text, value in (
                ("jaxstream_prefix_cache_queries", "Tokens of the text requests looked up in the prefix cache",
                 m.prefix_cache_queries),
                ("jaxstream_prefix_cache_hits", "Tokens of the text requests found in the prefix cache (their "
                 "prefill skipped)", m.prefix_cache_hits)):
            yield CounterMetricFamily(name, help_text, value=value)
