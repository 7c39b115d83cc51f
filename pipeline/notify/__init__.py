"""Delivery of anomalies to people: Slack, PagerDuty, Alertmanager and webhooks.

``config`` (the validated file) -> ``routing`` and ``silences`` (pure label logic) ->
``plan`` (per group and sink, what is due when: Alertmanager's group_wait, group_interval
and repeat_interval, with an injected clock) -> ``sinks/`` (payloads and HTTP, one module
a receiver) -> ``delivery`` (retries, one queue per sink) -> ``agent`` (the Faust wiring).
"""
