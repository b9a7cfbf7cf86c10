# ctxproxy: the same `ctxproxy serve` the tests start, in a slim Python image (pinned: a moving tag rebuilds on
# another Python and Debian without a change here).
FROM python:3.11.11-slim-bookworm

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY store ./store
COPY config ./config
COPY ctxproxy ./ctxproxy
# /data must exist and belong to the user before VOLUME: a named volume copies this ownership, and the
# journal cannot be created otherwise. The `postgresql` extra (psycopg, libpq bundled): the same image serves a
# journal in PostgreSQL (the `store` setting: a postgresql:// URL), as replicas behind a load balancer do.
RUN pip install --no-cache-dir '.[postgresql]' && useradd --create-home ctxproxy && mkdir /data && chown ctxproxy /data

USER ctxproxy
ENV CTXPROXY_DATA_DIR=/data \
    CTXPROXY_HOST=0.0.0.0 \
    CTXPROXY_PORT=4141
VOLUME ["/data"]
EXPOSE 4141
# /healthz answers anyone (the details only with the admin token); the slim image has no curl, Python has urllib.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CTXPROXY_PORT', '4141'), timeout=4)"]
# Bound beyond loopback, the server refuses to start without CTXPROXY_ADMIN_TOKEN (it guards /ctx/*).
ENTRYPOINT ["ctxproxy", "serve"]
