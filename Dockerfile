# The tpuray image that `tpuray k8s manifests --image IMAGE` runs: the native `tpuray`
# binary on PATH plus the Python package (the abi3 wheel of python-sdk/) so drivers,
# workers and `import tpuray` work in the pods. Build from the repository root:
#   docker build -t REGISTRY/tpuray:0.1.0 .
# (No image registry is reachable where tpuray is developed: this file was not built
# there; see README.md, "Kubernetes and GKE".)

FROM rust:1-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# protoc comes from the protoc-bin-vendored crate: cargo is all the build needs.
RUN cargo build --release -p tpuray-cli
RUN python3 -m venv /opt/maturin \
    && /opt/maturin/bin/pip install --no-cache-dir "maturin>=1.7,<2" \
    && /opt/maturin/bin/maturin build --release -m python-sdk/Cargo.toml -o /wheels

FROM python:3.11-slim-bookworm
# tini as PID 1: it forwards the kubelet's SIGTERM to `tpuray start --block` (which
# drains its node) and reaps orphaned processes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# The wheel's `tpuray` console script runs the same CLI through the extension; the
# native binary copied over it below starts faster.
RUN pip install --no-cache-dir /wheels/*.whl "numpy" "pyarrow" "tqdm" && rm -rf /wheels
COPY --from=build /src/target/release/tpuray /usr/local/bin/tpuray
# Session folders and logs (`--temp-dir` default); the object store uses /dev/shm,
# which the manifests mount as memory.
RUN mkdir -p /tmp/tpuray
# The manifests give the tpuray command as the pods' `args`.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["tpuray", "--help"]
