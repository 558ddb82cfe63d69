# jobs-server against the Ray cluster that RAY_ADDRESS names (its GCS address, host:6379).
# The image's Ray version must be the cluster's: by default the newest of the range that
# pyproject.toml declares; for a cluster on an older release of it, build with
# --build-arg RAY_VERSION=2.55.1 (a version outside the range fails the install). It listens on all
# of the container's interfaces, so it starts only with a token: run it with
# -e JOBS_SERVER_AUTH_TOKEN=... (or mount a file and set JOBS_SERVER_AUTH_TOKEN_FILE).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    JOBS_SERVER_HOST=0.0.0.0 \
    JOBS_SERVER_PORT=8266 \
    JOBS_SERVER_STATE_DIR=/var/lib/jobs-server \
    JOBS_SERVER_LOG_DIR=/var/lib/jobs-server/logs

RUN groupadd --system --gid 10001 jobs \
    && useradd --system --uid 10001 --gid jobs --home-dir /home/jobs --create-home jobs \
    && mkdir -p /var/lib/jobs-server/logs \
    && chown -R jobs:jobs /var/lib/jobs-server

WORKDIR /opt/jobs-server
COPY pyproject.toml README.md openapi.yaml ./
COPY jobs_server ./jobs_server
ARG RAY_VERSION=
RUN pip install --no-cache-dir . ${RAY_VERSION:+"ray[default]==${RAY_VERSION}"}

USER jobs
EXPOSE 8266
# The job history (jobs.db) and the logs: what must outlive the container.
VOLUME ["/var/lib/jobs-server"]

HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('JOBS_SERVER_PORT', '8266') + '/api/healthz', timeout=2)"]

ENTRYPOINT ["jobs-server"]
CMD ["serve"]
