# syntax=docker/dockerfile:1
# The statestore-async daemon image (one daemon per node; see helm/statestore-async).
#
#   docker build -t <registry>/statestore-async:0.1.0 .
#
# Stage "builder" compiles the Cython extensions into a wheel of the project and collects the
# runtime wheels; the final stage installs only those wheels (no compiler, no build deps) and runs
# as uid 10001. docker/build-steps.sh runs the same pip lines outside Docker (kept in sync by
# tests/test_image_steps.py): change both together.

ARG PYTHON_IMAGE=python:3.11-slim

# --- stage "builder" ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    WHEELS=/wheels
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/builder
ENV PATH=/opt/builder/bin:$PATH
WORKDIR /src
# Requirements first: the dependency layers are reused while only the sources change.
COPY requirements/ requirements/
RUN pip install -r requirements/build.txt
RUN pip wheel --wheel-dir "$WHEELS" -r requirements/runtime.txt
COPY pyproject.toml setup.py README.md ./
COPY _ext/ _ext/
COPY statestore_async/ statestore_async/
# Build products of an in-place build in the context are not sources.
RUN find . \( -name '__pycache__' -o -name '*.so' \) -prune -exec rm -rf {} +
RUN pip wheel --no-deps --no-build-isolation --wheel-dir "$WHEELS" .

# --- final stage -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG UID=10001
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    WHEELS=/wheels
RUN python -m venv /opt/statestore-async
ENV PATH=/opt/statestore-async/bin:$PATH
WORKDIR /install
COPY --from=builder /src/requirements/runtime.txt requirements/runtime.txt
# The wheels are bind-mounted from the builder, so they never become a layer of this image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links "$WHEELS" -r requirements/runtime.txt statestore-async \
    && rm -rf /install
WORKDIR /
RUN groupadd --system --gid ${UID} statestore \
    && useradd --system --uid ${UID} --gid ${UID} --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin statestore
# The socket directory and the cache are volumes in Kubernetes; these exist for `docker run`.
RUN mkdir -p /var/run/statestore-async /var/cache/statestore-async /etc/statestore-async \
    && chown ${UID}:${UID} /var/run/statestore-async /var/cache/statestore-async
USER ${UID}:${UID}
ENTRYPOINT ["statestore-async", "serve"]
CMD ["--config", "/etc/statestore-async/statestore.toml"]
