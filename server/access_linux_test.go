package server_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server"
)

// A grant to a uid or gid is the kernel's word for who connected: a client running
// under another uid gets what its uid or gid was granted, and this process does not.
func TestPeerGrantsOfAnotherUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to run a client under another uid")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	const nobody = 65534
	id := uint32(nobody)
	for _, tt := range []struct {
		name  string
		grant server.PeerGrant
	}{
		{"uid", server.PeerGrant{UID: &id, Allow: grants(t, "reserve:nomad/")}},
		{"gid", server.PeerGrant{GID: &id, Allow: grants(t, "reserve:nomad/")}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := startAccessHost(t, map[string]server.Allow{"read": grants(t, "read")}, []server.PeerGrant{tt.grant})
			// The other uid must reach the socket and run a copy of this binary.
			bin := filepath.Join(h.dir, "client.test")
			data, err := os.ReadFile(self)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(bin, data, 0o755); err != nil {
				t.Fatal(err)
			}
			sock := h.addrs["read"].Path
			for path, mode := range map[string]os.FileMode{h.dir: 0o755, sock: 0o666} {
				if err := os.Chmod(path, mode); err != nil {
					t.Fatal(err)
				}
			}
			cmd := exec.Command(bin)
			cmd.Env = append(os.Environ(), childReserveEnv+"="+sock)
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
			out, err := cmd.CombinedOutput()
			if got := strings.TrimSpace(string(out)); err != nil || got != "OK" {
				t.Fatalf("client as uid %d: %q, %v; want OK", nobody, got, err)
			}
			if got := h.takeReached(); len(got) != 1 || got[0] != "Reserve nomad/default/job/a/t" {
				t.Errorf("reached the manager: %q", got)
			}
			_, err = pb.NewDeviceHostClient(h.dial(t, "read")).Reserve(testContext(t), reserveReq("nomad/default/job/a/t"))
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("this process (uid %d): %v, want PERMISSION_DENIED", os.Getuid(), err)
			}
		})
	}
}
