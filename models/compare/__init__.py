"""Change verification: the requests after a marker against those before it.

``mix`` reweights the period after to the period before's segment mix and bootstraps within
segments; ``report`` turns that into a ``ChangeReport`` with a verdict per signal. Pure numpy,
no I/O: ``servewatch compare`` reads the files.
"""

from servewatch.models.compare.report import ChangeVerifier
from servewatch.models.compare.signals import SIGNALS, SignalSpec

__all__ = ["SIGNALS", "ChangeVerifier", "SignalSpec"]
