# The epd-proxy image, built from this checkout (docs/deploy.md):
#
#   docker build -t epd-proxy:0.1.0 .
#   docker run --rm -p 127.0.0.1:8000:8000 epd-proxy:0.1.0 serve --host 0.0.0.0 --simulate 'prefill=1,decode=1'
#
# BASE is any Debian-based image with Python >= 3.11 (python3 and its venv module): the
# official python:3.11-slim by default, or e.g. a Debian bookworm image with python3-venv
# (e2e/container.sh builds one from Debian packages). Both stages use it, so the
# virtualenv built in the first runs unchanged in the second.
ARG BASE=python:3.11-slim

# -- builder: wheels for the package and its dependencies (uvloop and httptools are
#    compiled here when the platform has no binary wheel), installed into /opt/venv.
FROM ${BASE} AS builder
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/venv/bin/pip wheel -q --wheel-dir /wheels . \
 && /opt/venv/bin/pip install -q --no-index --find-links /wheels epd-proxy \
 && /opt/venv/bin/python -c "import epd_proxy, uvloop, httptools, msgspec, blake3" \
 && /opt/venv/bin/pip uninstall -q -y pip

# -- runtime: the virtualenv only; no compiler, no pip, not root.
FROM ${BASE}
RUN groupadd --gid 10001 epd \
 && useradd --uid 10001 --gid epd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin epd
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HEALTHCHECK_PORT=8000
USER 10001:10001
EXPOSE 8000
# Liveness as Kubernetes probes it (/health never waits on a backend), with the standard
# library (no curl in the image). Set HEALTHCHECK_PORT when serving on another port.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['HEALTHCHECK_PORT'], timeout=2)"]
ENTRYPOINT ["epd-proxy"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
