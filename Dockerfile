# ctxproxy: the same `ctxproxy serve` the tests start, in a slim Python image.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY store ./store
COPY config ./config
# /data must exist and belong to the user before VOLUME: a named volume copies this ownership, and the
# journal cannot be created otherwise.
RUN pip install --no-cache-dir . && useradd --create-home ctxproxy && mkdir /data && chown ctxproxy /data

USER ctxproxy
ENV CTXPROXY_DATA_DIR=/data \
    CTXPROXY_HOST=0.0.0.0 \
    CTXPROXY_PORT=4141
VOLUME ["/data"]
EXPOSE 4141
# Bound beyond loopback, the server refuses to start without CTXPROXY_ADMIN_TOKEN (it guards /ctx/*).
ENTRYPOINT ["ctxproxy", "serve"]
