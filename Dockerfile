# The project image: the `gorgo` CLI (router, tuner, simulated fleet, replay) on python:3.11-slim.
# Envoy is not in it: the compose file runs the official envoyproxy/envoy image. No secret is baked
# in: the router's admin token comes from a mounted file at run time.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gorgo ./gorgo
COPY extproc ./extproc
COPY sim ./sim
COPY tuner ./tuner
# Runtime dependencies only (no dev extras: the CLI needs none of them).
RUN pip install . && rm -rf /src

# A non-root user; /run/gorgo (admin token) and /var/lib/gorgo (tuner state, replay results) are
# owned by it so that named volumes mounted there start out writable.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/gorgo gorgo \
    && mkdir -p /run/gorgo /var/lib/gorgo \
    && chown gorgo:gorgo /run/gorgo /var/lib/gorgo
USER gorgo
WORKDIR /home/gorgo

ENTRYPOINT ["gorgo"]
CMD ["--help"]
