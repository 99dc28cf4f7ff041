# fuse-supervisor, the node agent, as one static binary on an empty image.
# (The admission webhook has an image of its own: webhook/Dockerfile.)
#
# The binary is built beforehand, statically linked against glibc, and
# staged per architecture in the build context; so no base image is pulled
# and any builder works offline. From the repository (the Install section of
# docs/operations.md has the whole sequence, .ci/image runs it in CI):
#
#   RUSTFLAGS='-C target-feature=+crt-static' CARGO_PROFILE_RELEASE_STRIP=debuginfo \
#     cargo build --release --locked --target x86_64-unknown-linux-gnu --bin fuse-supervisor
#   install -D target/x86_64-unknown-linux-gnu/release/fuse-supervisor target/image/amd64/fuse-supervisor
#   buildah build --platform linux/amd64 -t fuse-supervisor:0.1.0 -f Dockerfile target/image
#
# (docker build and docker buildx build take the same arguments.)
FROM scratch
# Set by buildah and BuildKit from --platform: amd64, arm64.
ARG TARGETARCH
# Every binary staged for the architecture: the node agent (and, in CI's
# demo image, the test world's binary beside it).
COPY ${TARGETARCH}/ /usr/local/bin/
# For `kubectl exec ... -- fuse-supervisor status`.
ENV PATH=/usr/local/bin
# Root: runtimes give added capabilities to a non-root process only in its
# bounding set, where they do nothing.
USER 0:0
ENTRYPOINT ["/usr/local/bin/fuse-supervisor"]
CMD ["run"]
