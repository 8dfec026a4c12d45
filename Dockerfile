# syntax=docker/dockerfile:1
# outboxd as a container image: `docker build -t outboxd .` (docs/deploy.md).
#
# Build stage: the full Rust image of Debian 12 (it has the C toolchain, make and perl that the
# vendored librdkafka and OpenSSL need). Runtime stage: distroless "cc" of the same Debian 12
# (glibc, libgcc, CA certificates; no shell, no package manager), as its non-root user.
# Pin further by digest for reproducible builds:
#   docker build --build-arg RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot@sha256:… .
ARG BUILD_IMAGE=docker.io/library/rust:1.95.0-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY . .
# The registry and target directories are cache mounts: a rebuild after a code change compiles
# outboxd again, not librdkafka and OpenSSL. Cargo.lock is honoured (--locked).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p outboxd \
    && mkdir -p /out/lib \
    && cp target/release/outboxd /out/outboxd \
    && /out/outboxd --version \
    # zlib is linked dynamically (librdkafka's compression) and not part of the distroless base.
    && cp -L "/usr/lib/$(uname -m)-linux-gnu/libz.so.1" /out/lib/libz.so.1

FROM ${RUNTIME_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="outboxd" \
      org.opencontainers.image.description="Transactional outbox relay: Postgres WAL (pgoutput) to Kafka" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.documentation="docs/deploy.md"
COPY --from=build /out/lib/libz.so.1 /usr/lib/libz.so.1
COPY --from=build /out/outboxd /usr/local/bin/outboxd
COPY sql/ /usr/share/outboxd/sql/
# distroless's nonroot user (uid 65532); numeric, so Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
ENV OUTBOXD_CONFIG=/etc/outboxd/outboxd.toml
# The metrics listener (/metrics, /healthz, /readyz) when metrics.listen = "0.0.0.0:9187".
EXPOSE 9187
# Serving, or a standby ready to take over (see `outboxd probe --help`). Needs metrics.listen.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["outboxd", "probe", "ready"]
ENTRYPOINT ["outboxd"]
CMD ["run"]
