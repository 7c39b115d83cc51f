"""One version number for every record servewatch writes.

Bump it when a field changes meaning or a required field is added; readers accept older
versions they know how to read and reject newer ones with a clear error.
"""

SCHEMA_VERSION = 1
