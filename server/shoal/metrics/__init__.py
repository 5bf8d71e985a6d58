"""Prometheus metrics (`shoal:<name>`), shared across processes through prometheus-client's
multiprocess mode: every component writes to `$PROMETHEUS_MULTIPROC_DIR` (set by the launch
plan), the api's `/metrics` collects them all. Metrics exist only with --enable-metrics.
"""
