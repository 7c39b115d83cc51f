# One servewatch image for every role (worker, shipper, scraper): dependencies are installed
# when the image is built, never when a container starts.
#
#   docker build -t servewatch:local .
#   docker run --rm servewatch:local --version
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
# The package's folders (servewatch/ holds the root package and links to the others).
COPY pyproject.toml README.md ./
COPY servewatch/ servewatch/
COPY schemas/ schemas/
COPY models/ models/
COPY pipeline/ pipeline/
# rocksdb: SERVEWATCH_STORE=rocksdb:// for large detector state.
RUN pip install ".[rocksdb]" && cd / && rm -rf /src && servewatch --version

RUN useradd --system --create-home --uid 10001 servewatch \
    && mkdir -p /state /data && chown servewatch /state /data
USER servewatch
WORKDIR /home/servewatch
ENV SERVEWATCH_DATA_DIR=/data

ENTRYPOINT ["servewatch"]
CMD ["worker"]
