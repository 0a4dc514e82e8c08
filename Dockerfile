# The server's run image: the base install and the serve extra (onnxruntime-genai, starlette, uvicorn; no torch),
# serving a built package mounted at $PACKAGE (README "Serve it", "In a container").
#   docker build -t builder-plugin-serve .
#   docker run --rm -p 8000:8000 -v "$PWD/phi4mm-int4-cpu:/package:ro" builder-plugin-serve [SERVER OPTIONS...]
# Options after the image name go to python -m builder_plugin.serve (API keys: -e BUILDER_PLUGIN_API_KEYS=...).

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY builder_plugin ./builder_plugin
COPY genai_config ./genai_config
RUN python -m venv /opt/serve \
    && /opt/serve/bin/pip install --no-cache-dir --disable-pip-version-check ".[serve]"

FROM python:3.11-slim-bookworm
COPY --from=build /opt/serve /opt/serve
ENV PATH=/opt/serve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PACKAGE=/package \
    HOST=0.0.0.0 \
    PORT=8000
RUN groupadd --system --gid 10001 serve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin serve
# numeric, so that Kubernetes' runAsNonRoot can check it
USER 10001:10001
EXPOSE 8000
# Readiness and liveness: GET /health answers 200 once the package is loaded (nothing listens before) and until a
# stop signal (the listener closes at once; the answers in progress go on for --drain-seconds).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['PORT'], timeout=4)"]
# exec: the server is PID 1 and gets docker stop's SIGTERM (it drains, then exits 0)
ENTRYPOINT ["/bin/sh", "-c", "exec python -m builder_plugin.serve \"$PACKAGE\" --host \"$HOST\" --port \"$PORT\" \"$@\"", "serve"]
CMD []
