# The image that k8s/rayservice.yaml runs on every Ray pod: Ray's CUDA 12 image plus warpspec.
#   docker build -t registry.example.com/warpspec:0.1.0 . && docker push registry.example.com/warpspec:0.1.0
# RAY_VERSION must equal rayVersion in k8s/rayservice.yaml (tests/k8s checks it): the KubeRay operator,
# the autoscaler and the Serve config are all read against that version.
ARG RAY_VERSION=2.60.0
FROM rayproject/ray:${RAY_VERSION}-py311-gpu
ARG RAY_VERSION
# torch from PyTorch's CUDA 12 index, so it shares one CUDA major version with CuPy and the image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# torch.compile (the EAGLE-3 draft) and Triton build small C helpers at run time.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*
USER ray

# Heavy dependencies in their own layer, so a code change rebuilds in seconds. CuPy with the NCCL
# library is the workers' GPU collective backend (workers/distributed/comm.py); importing CuPy alone is not enough.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch>=2.6" \
 && pip install --no-cache-dir "cupy-cuda12x>=13" nvidia-nccl-cu12

# Serve's proxies reach replicas over gRPC rather than Ray actor calls, with no 4 MiB cap on that
# channel: what `warpspec serve` sets for the clusters it starts (serving/serve_cli.py, SERVE_ENVIRONMENT).
ENV RAY_SERVE_PROXY_USE_GRPC=1 RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=2147483647

WORKDIR /home/ray/warpspec
COPY --chown=ray:users . .
# Pinning Ray to the image's own version keeps pip from replacing it while resolving "ray[serve]>=2.40".
RUN pip install --no-cache-dir ".[gpu]" "ray[serve]==${RAY_VERSION}"
