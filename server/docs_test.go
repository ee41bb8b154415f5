package server_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Every RPC of the host API has a row in the README's Host API table and in
// docs/api.md's: a method added to the proto without its documentation fails here.
func TestEveryRPCIsDocumented(t *testing.T) {
	svc := pb.File_devicehost_v1_devicehost_proto.Services().ByName("DeviceHost")
	if svc == nil {
		t.Fatal("no service DeviceHost in devicehost.proto")
	}
	for _, doc := range []string{"README.md", filepath.Join("docs", "api.md")} {
		raw, err := os.ReadFile(filepath.Join("..", doc))
		if err != nil {
			t.Fatal(err)
		}
		rows := map[string]bool{}
		for _, line := range strings.Split(string(raw), "\n") {
			if name, ok := strings.CutPrefix(line, "| `"); ok {
				name, _, _ = strings.Cut(name, "`")
				rows[name] = true
			}
		}
		methods := svc.Methods()
		for i := range methods.Len() {
			if name := string(methods.Get(i).Name()); !rows[name] {
				t.Errorf("%s has no table row for the RPC %s (a line starting | `%s`)", doc, name, name)
			}
		}
	}
}
