// Package deviceplugintest runs a deviceplugin.Plugin in-process for tests, over a real
// go-plugin gRPC connection but without a child process.
package deviceplugintest

import (
	"testing"

	"github.com/hashicorp/go-plugin"

	"github.com/devicehost/devicehost/deviceplugin"
)

// Connect serves impl in-process through go-plugin's TestPluginGRPCConn and returns the
// host's client for it, exactly as the loader would get it (its ExitContext never ends).
// The connection, the server and their goroutines are stopped by t.Cleanup; the caller
// still calls SetConfig before the other RPCs, as a host does.
func Connect(t testing.TB, impl deviceplugin.Plugin) *deviceplugin.Client {
	t.Helper()
	set := deviceplugin.VersionedPlugins(deviceplugin.NewServer(impl))[deviceplugin.HandshakeVersion]
	client, server := plugin.TestPluginGRPCConn(t, false, set)
	t.Cleanup(func() {
		// Server first: client.Close would ask it to stop over the connection, and that
		// handler's Stop would race with ours.
		server.Stop()
		<-server.DoneCh
		_ = client.Close()
	})
	raw, err := client.Dispense(deviceplugin.PluginKey)
	if err != nil {
		t.Fatalf("dispense %q: %v", deviceplugin.PluginKey, err)
	}
	c, ok := raw.(*deviceplugin.Client)
	if !ok {
		t.Fatalf("dispense %q: got %T, want *deviceplugin.Client", deviceplugin.PluginKey, raw)
	}
	return c
}
