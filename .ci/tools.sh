#!/usr/bin/env bash
# Installs the pinned code-generation and lint tools into $(go env GOPATH)/bin.
# Source it or run it; CI runs it from .ci/run.
set -euo pipefail
BUF_VERSION=1.75.0
# buf's own release binary for linux/amd64, as its npm package @bufbuild/buf-linux-x64
# ships it (the npm registry is one this machine reaches; GitHub releases are not). Its
# sha512 is the registry's dist.integrity for that version, checked here as well. Building
# buf from source instead costs more CPU than the whole main module (535 packages): on a
# fresh 2-core machine that was most of this step's 12 minutes.
BUF_NPM_SHA512=YGGJAx0lpMCE7aMWjNOJcfoEaG/e+iYHnTC4SZ0P5eS4IffMryA9Z4/bb1m1wNXAEJ8ATFMEZOAk/5x9VE47ig==
bin="$(go env GOPATH)/bin"
mkdir -p "$bin"

# install_buf puts buf $BUF_VERSION into $bin: the release binary where it can, else built
# from source with go install (same version).
install_buf() {
  if [ -x "$bin/buf" ] && [ "$("$bin/buf" --version 2>/dev/null)" = "$BUF_VERSION" ]; then
    return
  fi
  if [ "$(go env GOOS)/$(go env GOARCH)" = linux/amd64 ] && command -v npm >/dev/null; then
    local tmp
    tmp=$(mktemp -d)
    if (cd "$tmp" && npm pack --silent "@bufbuild/buf-linux-x64@$BUF_VERSION" >/dev/null 2>&1) &&
      [ "$(openssl dgst -sha512 -binary "$tmp"/*.tgz | base64 -w0)" = "$BUF_NPM_SHA512" ] &&
      tar -xzf "$tmp"/*.tgz -C "$tmp" package/bin/buf &&
      [ "$("$tmp/package/bin/buf" --version)" = "$BUF_VERSION" ]; then
      install -m 0755 "$tmp/package/bin/buf" "$bin/buf"
      rm -rf "$tmp"
      echo "buf $BUF_VERSION: release binary (npm @bufbuild/buf-linux-x64, sha512 checked)"
      return
    fi
    rm -rf "$tmp"
    echo "buf $BUF_VERSION: no release binary from npm; building it from source"
  fi
  go install "github.com/bufbuild/buf/cmd/buf@v$BUF_VERSION"
}

install_buf
go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
go install honnef.co/go/tools/cmd/staticcheck@v0.8.2
