# SGLang's router (a Rust binary in a Python wheel), run with explicit workers: no SGLang engine inside.
FROM python:3.11-slim
ARG SGLANG_ROUTER_VERSION=0.3.2
RUN pip install --no-cache-dir sglang-router==${SGLANG_ROUTER_VERSION} \
    && groupadd --gid 10002 router && useradd --uid 10002 --gid 10002 --create-home router
# A numeric USER, so Kubernetes' runAsNonRoot can check it (deploy/k8s/replicas.yaml runs it as 10002:10002).
USER 10002:10002
EXPOSE 30000 29000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
