# syntax=docker/dockerfile:1
#
# fuse-supervisor as one static binary on an empty image.
#
#   docker build -t fuse-supervisor:0.1.0 .
#
# UNBUILT: the project's machines have no container engine, so this file has
# not been run. Built on Alpine, Rust's host target is musl, which links
# statically by default; the same file builds arm64 images on arm64.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-alpine AS build
# ring (rustls' cryptography) compiles C and assembly.
RUN apk add --no-cache musl-dev gcc binutils
WORKDIR /src
COPY . .
# Symbols stay for readable backtraces; debug line tables go.
ENV CARGO_PROFILE_RELEASE_STRIP=debuginfo
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin fuse-supervisor \
 && install -D -m 0755 target/release/fuse-supervisor /out/fuse-supervisor
# FROM scratch has no loader and no libc: refuse a dynamically linked binary
# here rather than ship one that cannot start.
RUN if readelf --program-headers /out/fuse-supervisor | grep -q INTERP; then \
      echo "fuse-supervisor is dynamically linked" >&2; exit 1; \
    fi \
 && /out/fuse-supervisor --version

FROM scratch
COPY --from=build /out/fuse-supervisor /usr/local/bin/fuse-supervisor
# For `kubectl exec ... -- fuse-supervisor status`.
ENV PATH=/usr/local/bin
# Root: runtimes give added capabilities to a non-root process only in its
# bounding set, where they do nothing.
USER 0:0
ENTRYPOINT ["/usr/local/bin/fuse-supervisor"]
CMD ["run"]
