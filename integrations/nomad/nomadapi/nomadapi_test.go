package nomadapi_test

import (
	"context"
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/nomad/structs"
	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/integrations/nomad/nomadapi"
	"github.com/devicehost/devicehost/integrations/nomad/nomadapi/nomadtest"
	"github.com/devicehost/devicehost/tools/testwait"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func newClient(t *testing.T, cfg nomadapi.Config) *nomadapi.Client {
	t.Helper()
	c, err := nomadapi.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

func ctx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	t.Cleanup(cancel)
	return ctx
}

// What the client decodes of Nomad v1.6.3's own structs, encoded as its HTTP server
// encodes them: the node of /v1/agent/self, and of each allocation its identity,
// statuses, indexes and each task's allocated device IDs.
func TestDecodesNomadStructs(t *testing.T) {
	s := nomadtest.New(t, nil)
	a := nomadtest.Alloc("ml", "train", "trainer", "NVIDIA H100 80GB HBM3", "GPU-a", "GPU-b")
	s.Place(a)
	b := nomadtest.Alloc("default", "infer", "server", "NVIDIA H100 80GB HBM3", "GPU-c")
	s.Place(b)
	s.SetClientStatus(b.ID, structs.AllocClientStatusFailed)
	c := newClient(t, nomadapi.Config{Address: s.URL()})

	self, err := c.Self(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if self.NodeID() != s.NodeID() {
		t.Fatalf("node ID %q, want %q", self.NodeID(), s.NodeID())
	}
	allocs, meta, err := c.NodeAllocations(ctx(t), self.NodeID(), nomadapi.Query{})
	if err != nil {
		t.Fatal(err)
	}
	if meta.Index != s.Index() {
		t.Errorf("index %d, want %d", meta.Index, s.Index())
	}
	want := []nomadapi.Allocation{
		{ID: a.ID, Namespace: "ml", JobID: "train", TaskGroup: a.TaskGroup, NodeID: s.NodeID(), DesiredStatus: "run", ClientStatus: "pending",
			AllocatedResources: &nomadapi.AllocatedResources{Tasks: map[string]*nomadapi.AllocatedTaskResources{
				"trainer": {Devices: []*nomadapi.AllocatedDeviceResource{{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3", DeviceIDs: []string{"GPU-a", "GPU-b"}}}},
			}},
			CreateIndex: a.CreateIndex, ModifyIndex: a.ModifyIndex},
		{ID: b.ID, Namespace: "default", JobID: "infer", TaskGroup: b.TaskGroup, NodeID: s.NodeID(), DesiredStatus: "run", ClientStatus: "failed",
			AllocatedResources: &nomadapi.AllocatedResources{Tasks: map[string]*nomadapi.AllocatedTaskResources{
				"server": {Devices: []*nomadapi.AllocatedDeviceResource{{Vendor: "nvidia", Type: "gpu", Name: "NVIDIA H100 80GB HBM3", DeviceIDs: []string{"GPU-c"}}}},
			}},
			CreateIndex: b.CreateIndex, ModifyIndex: s.Index()},
	}
	if !reflect.DeepEqual(allocs, want) {
		t.Errorf("allocations:\n got %+v\nwant %+v", allocs, want)
	}
	if !allocs[1].ClientTerminal() || allocs[0].ClientTerminal() {
		t.Errorf("ClientTerminal: pending %v, failed %v", allocs[0].ClientTerminal(), allocs[1].ClientTerminal())
	}
}

// ClientTerminal is Nomad's own ClientTerminalStatus for every client status.
func TestClientTerminalIsNomads(t *testing.T) {
	for _, st := range []string{structs.AllocClientStatusPending, structs.AllocClientStatusRunning, structs.AllocClientStatusComplete,
		structs.AllocClientStatusFailed, structs.AllocClientStatusLost, structs.AllocClientStatusUnknown} {
		a := nomadapi.Allocation{ClientStatus: st}
		if got, want := a.ClientTerminal(), (&structs.Allocation{ClientStatus: st}).ClientTerminalStatus(); got != want {
			t.Errorf("%s: ClientTerminal %v, Nomad's %v", st, got, want)
		}
	}
}

// A blocking query sends index and wait, answers when the allocations change past
// the index, with the new X-Nomad-Index, and carries the token.
func TestBlockingQuery(t *testing.T) {
	s := nomadtest.New(t, nil)
	c := newClient(t, nomadapi.Config{Address: s.URL(), Token: "secret-1"})
	allocs, meta, err := c.NodeAllocations(ctx(t), s.NodeID(), nomadapi.Query{})
	if err != nil || len(allocs) != 0 {
		t.Fatalf("empty node: %v, %v", allocs, err)
	}
	type answer struct {
		allocs []nomadapi.Allocation
		meta   nomadapi.Meta
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		a, m, err := c.NodeAllocations(ctx(t), s.NodeID(), nomadapi.Query{Index: meta.Index, Wait: time.Minute})
		done <- answer{a, m, err}
	}()
	waitRequests(t, s, 2)
	select {
	case a := <-done:
		t.Fatalf("the blocking query answered before any change: %+v", a)
	default:
	}
	id := s.Place(nomadtest.Alloc("default", "train", "t", "g", "GPU-a"))
	var got answer
	select {
	case got = <-done:
	case <-time.After(testwait.Timeout):
		t.Fatal("the blocking query did not answer the change")
	}
	if got.err != nil || len(got.allocs) != 1 || got.allocs[0].ID != id || got.meta.Index <= meta.Index {
		t.Errorf("after a placement: %+v (index before %d)", got, meta.Index)
	}
	reqs := s.Requests()
	if r := reqs[1]; r.Index == "" || r.Wait != "1m0s" || r.Token != "secret-1" {
		t.Errorf("blocking request %+v; want index, wait 1m0s and the token", r)
	}
	if r := reqs[0]; r.Index != "" {
		t.Errorf("first request %+v; want no index (answer at once)", r)
	}
}

// waitRequests waits until s has answered (or is answering) n requests.
func waitRequests(t *testing.T, s *nomadtest.Server, n int) {
	t.Helper()
	deadline := time.Now().Add(testwait.Timeout)
	for len(s.Requests()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests, want %d", len(s.Requests()), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// 403 and 5xx answers are StatusErrors with the code and the body on one escaped
// line; only 401 and 403 are IsForbidden.
func TestErrorAnswers(t *testing.T) {
	s := nomadtest.New(t, nil)
	c := newClient(t, nomadapi.Config{Address: s.URL()})
	for _, tc := range []struct {
		f         nomadtest.Failure
		forbidden bool
		want      string
	}{
		{nomadtest.Failure{Code: 403, Body: "Permission denied"}, true, "HTTP 403: Permission denied"},
		{nomadtest.Failure{Code: 500, Body: "No cluster leader\n\x1b[31mred"}, false, `HTTP 500: No cluster leader\n\x1b[31mred`},
		{nomadtest.Failure{Code: 503, Body: strings.Repeat("x", 4096)}, false, "HTTP 503: xxx"},
	} {
		s.Fail(&tc.f)
		_, err := c.Self(ctx(t))
		if err == nil || nomadapi.IsForbidden(err) != tc.forbidden || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%d: err %v (forbidden %v); want %q, forbidden %v", tc.f.Code, err, nomadapi.IsForbidden(err), tc.want, tc.forbidden)
		}
		if err != nil && len(err.Error()) > 700 {
			t.Errorf("%d: error of %d bytes; want the body cut", tc.f.Code, len(err.Error()))
		}
		_, _, err = c.NodeAllocations(ctx(t), s.NodeID(), nomadapi.Query{})
		if err == nil || nomadapi.IsForbidden(err) != tc.forbidden {
			t.Errorf("%d: allocations: %v", tc.f.Code, err)
		}
	}
	s.Fail(nil)
	if _, err := c.Self(ctx(t)); err != nil {
		t.Errorf("after the failures: %v", err)
	}
	s.Stop()
	if _, err := c.Self(ctx(t)); err == nil || nomadapi.IsForbidden(err) {
		t.Errorf("agent down: %v", err)
	}
}

// An answer with more allocations than MaxAllocations, or not an array, is an error.
func TestBoundsAllocations(t *testing.T) {
	body := "[" + strings.Repeat(`{"ID":"x"},`, nomadapi.MaxAllocations) + `{"ID":"y"}]`
	for _, tc := range []struct{ name, body, want string }{
		{"too many", body, "more than 10000 allocations"},
		{"not an array", `{"ID":"x"}`, "want an array"},
		{"truncated", `[{"ID":"x"}`, "decode"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("X-Nomad-Index", "5")
				_, _ = w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			c := newClient(t, nomadapi.Config{Address: srv.URL})
			_, _, err := c.NodeAllocations(ctx(t), "n", nomadapi.Query{})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %v, want %q", err, tc.want)
			}
		})
	}
}

// unix:// addresses reach an agent's socket; https verifies the agent's certificate
// with the CA file.
func TestAddresses(t *testing.T) {
	s := nomadtest.New(t, nil)
	proxy := func(w http.ResponseWriter, r *http.Request) {
		// Forward to the stand-in, as a second listener would.
		resp, err := http.Get(s.URL() + r.URL.RequestURI())
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		buf := make([]byte, 32<<10)
		for {
			n, err := resp.Body.Read(buf)
			_, _ = w.Write(buf[:n])
			if err != nil {
				return
			}
		}
	}

	t.Run("unix", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "nomad.sock")
		ln, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		srv := &httptest.Server{Listener: ln, Config: &http.Server{Handler: http.HandlerFunc(proxy)}}
		srv.Start()
		defer srv.Close()
		c := newClient(t, nomadapi.Config{Address: "unix://" + sock})
		if self, err := c.Self(ctx(t)); err != nil || self.NodeID() != s.NodeID() {
			t.Fatalf("over a unix socket: %v, %v", self, err)
		}
	})

	t.Run("https", func(t *testing.T) {
		srv := httptest.NewTLSServer(http.HandlerFunc(proxy))
		defer srv.Close()
		ca := filepath.Join(t.TempDir(), "ca.pem")
		if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
			t.Fatal(err)
		}
		c := newClient(t, nomadapi.Config{Address: srv.URL, CACert: ca})
		if self, err := c.Self(ctx(t)); err != nil || self.NodeID() != s.NodeID() {
			t.Fatalf("over https with the CA: %v, %v", self, err)
		}
		untrusting := newClient(t, nomadapi.Config{Address: srv.URL})
		if _, err := untrusting.Self(ctx(t)); err == nil || !strings.Contains(err.Error(), "certificate") {
			t.Errorf("over https without the CA: %v; want a certificate error", err)
		}
	})
}

// Settings come from the config first, then the environment Nomad's CLI reads, then
// the default address; malformed ones are errors naming them.
func TestConfig(t *testing.T) {
	env := map[string]string{"NOMAD_ADDR": "https://10.0.0.1:4646", "NOMAD_TOKEN": "env-token", "NOMAD_CACERT": "/etc/ca.pem",
		"NOMAD_CLIENT_CERT": "/etc/c.pem", "NOMAD_CLIENT_KEY": "/etc/k.pem", "NOMAD_TLS_SERVER_NAME": "client.global.nomad"}
	got := nomadapi.FromEnv(nomadapi.Config{Token: "config-token"}, func(k string) string { return env[k] })
	want := nomadapi.Config{Address: "https://10.0.0.1:4646", Token: "config-token", CACert: "/etc/ca.pem",
		ClientCert: "/etc/c.pem", ClientKey: "/etc/k.pem", TLSServerName: "client.global.nomad"}
	if got != want {
		t.Errorf("FromEnv:\n got %+v\nwant %+v", got, want)
	}
	c := newClient(t, nomadapi.Config{})
	if c.Address() != nomadapi.DefaultAddress {
		t.Errorf("default address %q, want %q", c.Address(), nomadapi.DefaultAddress)
	}
	for _, tc := range []struct {
		cfg  nomadapi.Config
		want string
	}{
		{nomadapi.Config{Address: "ftp://x"}, `scheme "ftp"`},
		{nomadapi.Config{Address: "127.0.0.1:4646"}, "want http://host:port"},
		{nomadapi.Config{Address: "unix://"}, "no socket path"},
		{nomadapi.Config{Address: "https://x:1", CACert: "/nonexistent/ca.pem"}, "nomad CA certificate"},
		{nomadapi.Config{Address: "https://x:1", ClientCert: "/c.pem"}, "set both"},
	} {
		if _, err := nomadapi.New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v): %v; want %q", tc.cfg, err, tc.want)
		}
	}
}
