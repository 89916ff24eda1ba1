# One image for every service; the default command runs the slot tracker. Every flag can also
# be given as an environment variable DYNAMO_LITE_<FLAG> (docs/configuration.md lists them).
#   docker build -t dynamo-lite .
#   docker run --rm -p 8091:8091 dynamo-lite
#   docker run --rm -p 8090:8090 -v dynamo-lite-index:/data \
#       -e DYNAMO_LITE_SNAPSHOT=/data/index.json dynamo-lite python -m dynamo_lite.indexer
#   docker run --rm -p 8000:8000 dynamo-lite python -m dynamo_lite.mock_engine   # engine stand-in
#   docker run --rm -p 9002:9002 -p 9003:9003 -v "$PWD/pool.yaml:/etc/dynamo-lite/pool.yaml:ro" \
#       dynamo-lite python -m dynamo_lite.epp --pool /etc/dynamo-lite/pool.yaml \
#       --slot-tracker http://<host>:8091 --indexer http://<host>:8090           # endpoint picker
# deploy/compose/gateway.yaml runs all of them behind Envoy.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# Package data that are symlinks into these folders (pyproject.toml, package-data): the services'
# OpenAPI documents, and the endpoint picker's Envoy configuration. The engine stand-in's and the
# picker's default tokenizer (services/mock_engine/tokenizer/) comes with services/ above.
COPY openapi ./openapi
COPY deploy/envoy ./deploy/envoy
RUN pip install . && rm -rf /src

RUN useradd --create-home --uid 10001 dynamo && mkdir /data && chown dynamo /data
USER dynamo
WORKDIR /home/dynamo

# Slot tracker, indexer, engine stand-in (HTTP, then its KV events PUB and replay sockets),
# endpoint picker (gRPC ext_proc, then HTTP /metrics /health /ready /pool).
EXPOSE 8091 8090 8000 5557 5558 9002 9003
# Liveness of whichever service the command started: $DYNAMO_LITE_METRICS_PORT (the endpoint
# picker's HTTP side; its DYNAMO_LITE_PORT is gRPC), else $DYNAMO_LITE_PORT, else the default
# ports 8091, 8090, 9003 and 8000 in turn. (Orchestrators that route traffic should also watch
# GET /ready; see deploy/.)
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-m", "dynamo_lite.probe", "--path", "/health"]

# SIGTERM (docker stop) drains in-flight requests and writes the indexer's snapshot.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "dynamo_lite.slot_tracker"]
