#!/usr/bin/env bash
# Installs the pinned code-generation and lint tools into $(go env GOPATH)/bin.
# Source it or run it; CI runs it from .ci/run.
set -euo pipefail
go install github.com/bufbuild/buf/cmd/buf@v1.75.0
go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
go install honnef.co/go/tools/cmd/staticcheck@v0.8.2
