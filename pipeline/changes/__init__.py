"""Change verification, live: each change marker's requests after against before.

``config`` reads the periods and rollback conditions, ``watch`` keeps one change's two
periods and judges them (``models.compare``), ``agent`` wires it into a Faust app: markers in,
``ChangeReport`` records and ``rollback_condition_met`` anomalies out.
"""
