// Package proto holds the .proto files of the host API (devicehost/v1) and of the plugin
// protocol (deviceplugin/v1), with their generated Go code side by side.
//
// Regenerate after editing a .proto (tools pinned in .ci/tools.sh):
//
//	go generate ./proto
package proto

//go:generate sh -c "cd .. && buf lint && buf generate"
