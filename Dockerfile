# The project images: the `gorgo` CLI on python:3.11-slim, one target per job.
#   router (the last stage, so the default of `docker build .`): runtime dependencies only, no
#     matplotlib. It serves every project service in docker-compose.yaml: the router, the tuner,
#     the simulated fleet, the replay load generator.
#   sim: the router image's packages plus the `[sim]` extra (matplotlib), for `gorgo bench sim` and
#     `gorgo bench tune` with their plots: `docker build --target sim -t gorgo-sim:local .`
# Envoy is not in either: the compose file runs the official envoyproxy/envoy image. No secret is
# baked in: the router's admin token comes from a mounted file at run time.
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A non-root user; /run/gorgo (admin token) and /var/lib/gorgo (tuner state, replay results) are
# owned by it so that named volumes mounted there start out writable.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/gorgo gorgo \
    && mkdir -p /run/gorgo /var/lib/gorgo \
    && chown gorgo:gorgo /run/gorgo /var/lib/gorgo

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gorgo ./gorgo
COPY extproc ./extproc
COPY tuner ./tuner

ENTRYPOINT ["gorgo"]
CMD ["--help"]

FROM base AS sim
RUN pip install '.[sim]' && rm -rf /src
# The shipped traces, so `gorgo bench sim` runs out of the box (the install is not editable, so
# the repository's data/traces is not beside the package).
COPY data/traces /opt/gorgo/traces
ENV GORGO_TRACES=/opt/gorgo/traces
USER gorgo
WORKDIR /home/gorgo

FROM base AS router
# Runtime dependencies only: no extras, so no matplotlib (docs/dependencies.md).
RUN pip install . && rm -rf /src
USER gorgo
WORKDIR /home/gorgo
