"""servewatch: streaming anomaly detection for LLM serving fleets (vLLM, SGLang).

The repository keeps the product card's top level (``schemas/``, ``models/``, ``pipeline/``);
installed, they live under this one import name so that they never collide with another
distribution's ``models`` or ``pipeline``:

* ``servewatch.schemas``: wire formats (pydantic only);
* ``servewatch.models``: online statistical models (river + numpy, no I/O);
* ``servewatch.pipeline``: Kafka, Faust, HTTP, settings and the command line.

``pyproject.toml`` maps the three folders into this package (``[tool.setuptools.package-dir]``),
which works for wheels and for editable installs alike. The links in this folder
(``servewatch/models -> ../models``...) give tools that read the tree rather than import it
(mypy, or ``python -m servewatch`` in a checkout that was never installed) the same view.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("servewatch")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"
