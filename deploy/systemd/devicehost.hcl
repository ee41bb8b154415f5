# devicehost agent config for the systemd unit beside it: install as
# /etc/devicehost/devicehost.hcl. Its paths are the unit's directories; see docs/operations.md,
# "Running under systemd", and docs/configuration.md for every key.

listen     = "unix:///run/devicehost/devicehost.sock" # RuntimeDirectory=devicehost (0750; socket 0660)
state_dir  = "/var/lib/devicehost"                    # StateDirectory=devicehost: ledger, kept plugins' sockets
plugin_dir = "/opt/devicehost/plugins"                # read-only to the agent (ProtectSystem=strict)
log_level  = "info"                                   # journald keeps plain lines; log_json = true for JSON

# listen is the admin socket (the CLI, operators). Each client of the node gets a socket
# of its own that allows what it needs and no more (docs/configuration.md, "Access"):
# the Nomad shim (nomad-device-devicehost, address = this socket) may reserve for Nomad
# allocations only, monitoring may read.
listener "nomad" {
  address = "unix:///run/devicehost/nomad/devicehost.sock"
  allow   = ["read", "reserve:nomad/"]
}
listener "monitoring" {
  address = "unix:///run/devicehost/read-only/devicehost.sock"
  allow   = ["read"]
}

plugin "nvidia-example" {
  # sha256 = "<sha256sum /opt/devicehost/plugins/nvidia-example>"
  # reattach = true    # keep the plugin running across an agent crash: needs the unit's KillMode=process
  config {
    # The CDI spec, so runtimes resolve nvidia.com/gpu=<UUID>: writable through the
    # unit's ReadWritePaths=-/run/cdi (/var/run is /run). "" writes none.
    cdi_spec_dir = "/var/run/cdi"
  }
}
