# devicehost: the agent binary, the nvidia-example and hostdev plugins in the plugin dir, the DRA
# driver (devicehost-dra-plugin, from the integrations/dra module), the node labels and
# condition writer (devicehost-node-status, from the same module), and
# grpc_health_probe for the health checks. Builds as docs/operations.md, "Build and Docker", says.
#
#   docker build -t devicehost .
#   scripts/image -o devicehost.tar     # the same without Docker (buildah), for ctr images import
#   docker run --rm -v /run/devicehost:/run/devicehost devicehost agent -dev -listen unix:///run/devicehost/devicehost.sock

FROM golang:1.26-trixie AS build
WORKDIR /src
# go-nvml needs cgo; libnvidia-ml itself is loaded at run time, not linked. Its header
# marks many NVML calls deprecated, which would print ~29 harmless C warnings.
ENV CGO_ENABLED=1 CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations"
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# The version `devicehost version` prints and the agent logs (scripts/image passes the git
# commit); declared after the download so a new version reuses its layer.
ARG VERSION=dev
RUN go build -trimpath -ldflags "-X main.version=${VERSION}" -o /out/devicehost ./cmd/devicehost \
 && go build -trimpath -o /out/plugins/nvidia-example ./plugins/nvidia-example \
 && CGO_ENABLED=0 go build -trimpath -o /out/plugins/hostdev ./plugins/hostdev \
 && (cd integrations/dra && CGO_ENABLED=0 go build -trimpath -o /out/devicehost-dra-plugin ./cmd/devicehost-dra-plugin \
     && CGO_ENABLED=0 go build -trimpath -o /out/devicehost-node-status ./cmd/devicehost-node-status) \
 && GOBIN=/out CGO_ENABLED=0 go install github.com/grpc-ecosystem/grpc-health-probe@v0.4.62

FROM debian:trixie-slim
COPY --from=build /out/devicehost /usr/local/bin/devicehost
COPY --from=build /out/devicehost-dra-plugin /usr/local/bin/devicehost-dra-plugin
COPY --from=build /out/devicehost-node-status /usr/local/bin/devicehost-node-status
COPY --from=build /out/grpc-health-probe /usr/local/bin/grpc_health_probe
COPY --from=build /out/plugins/ /opt/devicehost/plugins/
RUN mkdir -p /var/lib/devicehost /run/devicehost \
 && chmod 0755 /opt/devicehost/plugins /opt/devicehost/plugins/nvidia-example /opt/devicehost/plugins/hostdev \
 && chmod 0700 /var/lib/devicehost && chmod 0750 /run/devicehost
# Plugins are dropped in here; state survives restarts there; the API socket is shared
# with the host (and the runtime that calls it) through the last.
VOLUME ["/opt/devicehost/plugins", "/var/lib/devicehost", "/run/devicehost"]
# SERVING once every plugin has fingerprinted or failed; NOT_SERVING while shutting down.
HEALTHCHECK --interval=15s --timeout=5s --start-period=40s --retries=3 \
  CMD ["grpc_health_probe", "-addr", "unix:///run/devicehost/devicehost.sock", "-service", "devicehost.v1.DeviceHost"]
# The agent stops cleanly on SIGTERM (docker stop): API first, then plugins.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/devicehost"]
CMD ["agent"]
