"""The triage page (``servewatch web``): what is firing, why, and on-call's verdicts, in a browser.

A small aiohttp server over the anomaly, series, feedback and changes topics, with no database and
no front-end build: HTML rendered on the server, inline SVG charts, one vanilla script.

* ``store``: the topics folded into bounded memory, and the queries the pages and API ask;
* ``feed``: the Kafka side (topics into the store, verdicts to ``servewatch.feedback``);
* ``server``: routes (pages, ``/api/...``, server-sent events, verdicts);
* ``auth``: the Host check, token, session cookie, CSRF and security headers;
* ``render`` (list, segments, login) and ``detail`` (a group, an incident): the HTML;
* ``changes``: change markers on charts and incidents, the changes view with each report;
* ``charts``: the SVG (a signal against its band, the load beneath, sparklines);
* ``links``: links out to the user's log search and dashboards, Grafana annotations;
* ``openapi``: the API's OpenAPI 3.1 description;
* ``static/``: ``app.js`` and ``app.css``, served locally.
"""
