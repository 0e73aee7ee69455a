# idemgate container image: the proxy binary, the reference config and the Lua scripts.
#
#   docker build -t example.com/idemgate:0.1.0 .
#   docker run --rm -p 6180:6180 -v "$PWD/conf:/etc/idemgate:ro" example.com/idemgate:0.1.0
#
# (conf/ holding your idemgate.yaml; without it the reference config below is used.)
#
# The Kubernetes examples in examples/kubernetes/ run this image with their own config mounted
# over /etc/idemgate (a ConfigMap volume).

ARG RUST_VERSION=1.95

# --- build ------------------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-bookworm AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# pingora-core always builds zlib-ng, whose build script needs cmake. TLS is rustls (ring), so
# neither OpenSSL headers nor pkg-config are needed. (Versions are not pinned: Debian replaces
# them in point releases, and a pinned version that left the archive breaks the build.)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src

# Dependency layer: compile every dependency against a stub crate, so an edit under src/ or lua/
# reuses this layer instead of rebuilding pingora, tokio and redis (minutes on a small builder).
# Only the manifest and the lock file are copied, so this layer changes only when they do.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked --bin idemgate \
 && rm -rf src

# The real build. The stub's artefacts must not be taken for up to date: COPY keeps the build
# context's (older) timestamps, which cargo's mtime check would call fresh, so drop the stub's
# fingerprints and touch the crate roots. lua/ is compiled in (include_str!).
COPY src ./src
COPY lua ./lua
RUN rm -rf target/release/.fingerprint/idemgate-* \
 && touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin idemgate \
 && target/release/idemgate --version | grep -q '^idemgate ' \
 && cp target/release/idemgate /usr/local/bin/idemgate

# --- runtime ----------------------------------------------------------------------------------
FROM debian:bookworm-slim

# The binary links only glibc (same Debian release as the builder). ca-certificates: rediss://
# uses the Mozilla roots compiled into the binary, but a system bundle costs little and helps
# anything else in the image that speaks TLS.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# Unprivileged user with a fixed numeric id (65532, the usual "nonroot"), so Kubernetes'
# runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 65532 idemgate \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin idemgate \
 && install -d -o 65532 -g 65532 -m 0750 /var/lib/idemgate

COPY --from=builder /usr/local/bin/idemgate /usr/local/bin/idemgate
# The reference config (every key with its default): proxy on 0.0.0.0:6180, admin on
# 127.0.0.1:6181 (loopback: publish 6181 only with a config whose admin.listen is 0.0.0.0),
# backends on 127.0.0.1:8080/8081. Mount your own over /etc/idemgate.
COPY config/idemgate.yaml /etc/idemgate/idemgate.yaml
# The scripts the binary embeds, shipped for reference (and for versioned-script configs).
COPY lua/ /usr/share/idemgate/lua/

# The working directory is where a relative store.completion_retry.dead_letter_path (the
# default, idemgate-dead-letter.jsonl) is written; in Kubernetes it is a volume.
WORKDIR /var/lib/idemgate
USER 65532:65532

# 6180 proxy, 6181 admin (/healthz, /readyz, /metrics, /admin/...).
EXPOSE 6180 6181

# SIGTERM is idemgate's graceful drain: listeners close, in-flight requests finish and their
# records are stored, then it exits 0 (within shutdown.grace_period + graceful_shutdown_timeout,
# + up to 5 s writing the last dead letters at exit).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["--config", "/etc/idemgate/idemgate.yaml"]
