# SGLang's router (a Rust binary in a Python wheel), run with explicit workers: no SGLang engine inside.
FROM python:3.11-slim
ARG SGLANG_ROUTER_VERSION=0.3.2
RUN pip install --no-cache-dir sglang-router==${SGLANG_ROUTER_VERSION} \
    && useradd --create-home router
USER router
EXPOSE 30000 29000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
