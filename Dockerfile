# One image for both services; the default command runs the slot tracker.
#   docker build -t dynamo-lite .
#   docker run --rm -p 8091:8091 dynamo-lite
#   docker run --rm -p 8090:8090 dynamo-lite python -m dynamo_lite.indexer --host 0.0.0.0 --port 8090
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

RUN useradd --create-home --uid 10001 dynamo
USER dynamo
WORKDIR /home/dynamo

EXPOSE 8091 8090
# Probes whichever service the command started (both serve GET /health).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD python -c "import os, sys, urllib.request; port = os.environ.get('HEALTH_PORT', '8091'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=2).status == 200 else 1)"

CMD ["python", "-m", "dynamo_lite.slot_tracker", "--host", "0.0.0.0", "--port", "8091"]
