# One image for both services; the default command runs the slot tracker. Every flag can also
# be given as an environment variable DYNAMO_LITE_<FLAG> (see the README, "Observability").
#   docker build -t dynamo-lite .
#   docker run --rm -p 8091:8091 dynamo-lite
#   docker run --rm -p 8090:8090 -v dynamo-lite-index:/data \
#       -e DYNAMO_LITE_SNAPSHOT=/data/index.json dynamo-lite python -m dynamo_lite.indexer
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY openapi ./openapi
RUN pip install . && rm -rf /src

RUN useradd --create-home --uid 10001 dynamo && mkdir /data && chown dynamo /data
USER dynamo
WORKDIR /home/dynamo

EXPOSE 8091 8090
# Liveness of whichever service the command started: $DYNAMO_LITE_PORT, else 8091 then 8090.
# (Orchestrators that route traffic should also watch GET /ready; see deploy/.)
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-m", "dynamo_lite.probe", "--path", "/health"]

# SIGTERM (docker stop) drains in-flight requests and writes the indexer's snapshot.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "dynamo_lite.slot_tracker"]
