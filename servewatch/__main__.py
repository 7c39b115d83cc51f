"""``python -m servewatch``: the same as the ``servewatch`` command."""

from servewatch.pipeline.cli.main import main

raise SystemExit(main())
