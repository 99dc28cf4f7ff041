# fuse-supervisor as static binaries on an empty image: the node agent (the
# entrypoint) and the admission webhook.
#
# The binaries are built beforehand, statically linked against glibc, and
# staged per architecture in the build context; so no base image is pulled
# and any builder works offline. From the repository (the Install section of
# docs/operations.md has the whole sequence, .ci/image runs it in CI):
#
#   RUSTFLAGS='-C target-feature=+crt-static' CARGO_PROFILE_RELEASE_STRIP=debuginfo \
#     cargo build --release --locked --target x86_64-unknown-linux-gnu --bin fuse-supervisor
#   RUSTFLAGS='-C target-feature=+crt-static' CARGO_PROFILE_RELEASE_STRIP=debuginfo \
#     cargo build --release --locked --target x86_64-unknown-linux-gnu -p fuse-supervisor-webhook
#   for bin in fuse-supervisor fuse-supervisor-webhook; do
#     install -D target/x86_64-unknown-linux-gnu/release/$bin target/image/amd64/$bin
#   done
#   buildah build --platform linux/amd64 -t fuse-supervisor:0.1.0 -f Dockerfile target/image
#
# (docker build and docker buildx build take the same arguments.)
FROM scratch
# Set by buildah and BuildKit from --platform: amd64, arm64.
ARG TARGETARCH
# Every binary staged for the architecture.
COPY ${TARGETARCH}/ /usr/local/bin/
# For `kubectl exec ... -- fuse-supervisor status`.
ENV PATH=/usr/local/bin
# Root: runtimes give added capabilities to a non-root process only in its
# bounding set, where they do nothing.
USER 0:0
ENTRYPOINT ["/usr/local/bin/fuse-supervisor"]
CMD ["run"]
