"""A real Prometheus and promtool on live /metrics, with the shipped config, alert rules and dashboard."""
