package cdi_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"go.uber.org/goleak"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/devicehost/devicehost/deviceplugin/cdi"
)

// The package and the CDI cache it uses (auto-refresh off) start no goroutines.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const kind = "acme.example/widget"

// widgetSpec is a plugin's spec: one device node per widget (absent on this host, so
// given by numbers) and a shared control node and env var.
func widgetSpec(ids ...string) cdi.Spec {
	s := cdi.Spec{
		Kind:    kind,
		Devices: map[string]cdi.Edits{},
		Common: cdi.Edits{
			Env:         map[string]string{"WIDGET_DRIVER": "v2"},
			DeviceNodes: []cdi.DeviceNode{{HostPath: "/dev/widgetctl", ContainerPath: "/dev/widgetctl", Permissions: "rw"}},
		},
		Nodes: map[string]cdi.Node{"/dev/widgetctl": {Type: "c", Major: 240, Minor: 255}},
	}
	for i, id := range ids {
		path := "/dev/widget" + id
		s.Devices[id] = cdi.Edits{
			DeviceNodes: []cdi.DeviceNode{{HostPath: path, ContainerPath: path, Permissions: "rw"}},
			Mounts:      []cdi.Mount{{HostPath: "/opt/widget/fw-" + id, ContainerPath: "/lib/firmware/widget-" + id, ReadOnly: true}},
		}
		s.Nodes[path] = cdi.Node{Type: "c", Major: 240, Minor: int64(i)}
	}
	return s
}

func newWriter(t *testing.T) (*cdi.Writer, string) {
	t.Helper()
	dir := t.TempDir()
	w, err := cdi.NewWriter(dir, "devicehost-widgets")
	if err != nil {
		t.Fatalf("NewWriter: %v", err)
	}
	return w, dir
}

// runtimeCache reads dir the way a container runtime does: the CDI library's cache.
func runtimeCache(t *testing.T, dir string) *cdiapi.Cache {
	t.Helper()
	c, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatalf("NewCache: %v", err)
	}
	if errs := c.GetErrors(); len(errs) > 0 {
		t.Fatalf("the CDI cache found errors in %s: %v", dir, errs)
	}
	return c
}

func newOCISpec() *oci.Spec {
	return &oci.Spec{Process: &oci.Process{Env: []string{"PATH=/usr/bin"}}, Linux: &oci.Linux{}}
}

func TestWriteThenInject(t *testing.T) {
	w, dir := newWriter(t)
	if _, err := w.Write(widgetSpec("w0", "w1", "w2")); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if got, want := w.Path(), filepath.Join(dir, "devicehost-widgets.yaml"); got != want {
		t.Errorf("Path = %q, want %q", got, want)
	}
	cache := runtimeCache(t, dir)
	if got, want := cache.ListDevices(), []string{kind + "=w0", kind + "=w1", kind + "=w2"}; !slices.Equal(got, want) {
		t.Fatalf("devices in the spec dir = %v, want %v", got, want)
	}

	spec := newOCISpec()
	if unresolved, err := cache.InjectDevices(spec, cdi.Name(kind, "w2"), cdi.Name(kind, "w0")); err != nil {
		t.Fatalf("InjectDevices: %v (unresolved %v)", err, unresolved)
	}
	if got, want := spec.Process.Env, []string{"PATH=/usr/bin", "WIDGET_DRIVER=v2"}; !slices.Equal(got, want) {
		t.Errorf("env = %q, want %q", got, want)
	}
	var nodes []string
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, fmt.Sprintf("%s %s %d:%d", d.Path, d.Type, d.Major, d.Minor))
	}
	slices.Sort(nodes)
	if want := []string{"/dev/widgetctl c 240:255", "/dev/widgetw0 c 240:0", "/dev/widgetw2 c 240:2"}; !slices.Equal(nodes, want) {
		t.Errorf("device nodes = %q, want %q", nodes, want)
	}
	if spec.Linux.Resources == nil || len(spec.Linux.Resources.Devices) != 3 {
		t.Fatalf("cgroup device rules = %+v, want 3", spec.Linux.Resources)
	}
	for _, r := range spec.Linux.Resources.Devices {
		if !r.Allow || r.Access != "rw" || r.Major == nil || *r.Major != 240 {
			t.Errorf("cgroup rule %+v, want allow rw on major 240", r)
		}
	}
	var mounts []string
	for _, m := range spec.Mounts {
		mounts = append(mounts, m.Source+" -> "+m.Destination+" "+strings.Join(m.Options, ","))
	}
	slices.Sort(mounts)
	want := []string{
		"/opt/widget/fw-w0 -> /lib/firmware/widget-w0 rbind,rprivate,nosuid,nodev,ro",
		"/opt/widget/fw-w2 -> /lib/firmware/widget-w2 rbind,rprivate,nosuid,nodev,ro",
	}
	if !slices.Equal(mounts, want) {
		t.Errorf("mounts = %q, want %q", mounts, want)
	}
}

// Without numbers, a runtime needs the node on the host: injection of a device whose
// node is missing fails. This is the CDI library's rule that Spec.Nodes is for.
func TestNodeWithoutNumbersMustExistOnHost(t *testing.T) {
	w, dir := newWriter(t)
	s := widgetSpec("w0")
	delete(s.Nodes, "/dev/widgetw0")
	if _, err := w.Write(s); err != nil {
		t.Fatalf("Write: %v", err)
	}
	_, err := runtimeCache(t, dir).InjectDevices(newOCISpec(), cdi.Name(kind, "w0"))
	if err == nil || !strings.Contains(err.Error(), "/dev/widgetw0") {
		t.Errorf("InjectDevices = %v, want an error about the missing /dev/widgetw0", err)
	}
}

func TestDevicesThatLeaveLeaveTheSpec(t *testing.T) {
	w, dir := newWriter(t)
	if _, err := w.Write(widgetSpec("w0", "w1")); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if _, err := w.Write(widgetSpec("w0")); err != nil {
		t.Fatalf("Write: %v", err)
	}
	cache := runtimeCache(t, dir)
	if got, want := cache.ListDevices(), []string{kind + "=w0"}; !slices.Equal(got, want) {
		t.Errorf("devices after w1 left = %v, want %v", got, want)
	}
	if unresolved, err := cache.InjectDevices(newOCISpec(), cdi.Name(kind, "w1")); err == nil || !slices.Equal(unresolved, []string{kind + "=w1"}) {
		t.Errorf("injecting the departed w1 = %v, %v; want it unresolved", unresolved, err)
	}

	if _, err := w.Write(widgetSpec()); err != nil {
		t.Fatalf("Write with no devices: %v", err)
	}
	if _, err := os.Stat(w.Path()); !os.IsNotExist(err) {
		t.Errorf("spec with no devices: stat = %v, want the file removed", err)
	}
	if err := w.Remove(); err != nil {
		t.Errorf("Remove of a missing file: %v", err)
	}
}

type fileID struct {
	ino   uint64
	mtime syscall.Timespec
	mode  os.FileMode
}

func statFile(t *testing.T, path string) fileID {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("stat: %v", err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	return fileID{ino: st.Ino, mtime: st.Mtim, mode: fi.Mode().Perm()}
}

// A change replaces the file by rename (a new inode: a reader has the old file or the
// new one, never half of one); no change leaves it alone; no temporary file is left;
// changed tells which happened.
func TestWriteReplacesOnlyOnChange(t *testing.T) {
	w, dir := newWriter(t)
	write := func(s cdi.Spec, wantChanged bool) {
		t.Helper()
		changed, err := w.Write(s)
		if err != nil {
			t.Fatalf("Write: %v", err)
		}
		if changed != wantChanged {
			t.Errorf("Write of %d devices: changed = %v, want %v", len(s.Devices), changed, wantChanged)
		}
	}
	write(widgetSpec("w0", "w1"), true)
	first := statFile(t, w.Path())
	if first.mode != 0o644 {
		t.Errorf("mode = %v, want 0644 (readable by every runtime)", first.mode)
	}
	write(widgetSpec("w0", "w1"), false)
	if again := statFile(t, w.Path()); again != first {
		t.Errorf("unchanged spec: file changed from %+v to %+v, want untouched", first, again)
	}
	write(widgetSpec("w0"), true)
	if changed := statFile(t, w.Path()); changed.ino == first.ino {
		t.Errorf("changed spec was written in place (inode %d kept), want a new file renamed over it", first.ino)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].Name() != "devicehost-widgets.yaml" {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("spec dir holds %q, want only devicehost-widgets.yaml", names)
	}
	write(widgetSpec(), true) // removed
	write(widgetSpec(), false)
}

// A spec file someone removed (a cleaned /var/run/cdi) comes back on the next Write.
func TestWriteRestoresARemovedFile(t *testing.T) {
	w, _ := newWriter(t)
	if _, err := w.Write(widgetSpec("w0")); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if err := os.Remove(w.Path()); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(widgetSpec("w0")); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if _, err := os.Stat(w.Path()); err != nil {
		t.Errorf("spec not restored: %v", err)
	}
}

func TestNewWriterRefuses(t *testing.T) {
	tests := []struct {
		dir, name, want string
	}{
		{"", "x", "empty"},
		{"var/run/cdi", "x", `"var/run/cdi": must be an absolute path`},
		{"./cdi", "x", "must be an absolute path"},
		{"/var/run/cdi", "", "file name"},
		{"/var/run/cdi", "../etc/x", `file name "../etc/x"`},
		{"/var/run/cdi", "a/b", "file name"},
		{"/var/run/cdi", "..", "file name"},
	}
	for _, tt := range tests {
		w, err := cdi.NewWriter(tt.dir, tt.name)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("NewWriter(%q, %q) = %v, %v; want an error containing %q", tt.dir, tt.name, w, err, tt.want)
		}
	}
}

// A spec CDI would reject is refused naming what is wrong, and the file on disk stays
// as it was.
func TestWriteRefusesBadSpecs(t *testing.T) {
	tests := []struct {
		name   string
		change func(*cdi.Spec)
		want   string
	}{
		{"kind without class", func(s *cdi.Spec) { s.Kind = "acme.example" }, `kind "acme.example"`},
		{"bad vendor", func(s *cdi.Spec) { s.Kind = "acme!/widget" }, `kind "acme!/widget"`},
		{"bad device ID", func(s *cdi.Spec) { s.Devices["w 1"] = cdi.Edits{} }, `device "w 1"`},
		{"node without host path", func(s *cdi.Spec) {
			s.Common.DeviceNodes = append(s.Common.DeviceNodes, cdi.DeviceNode{ContainerPath: "/dev/x"})
		}, "common edits: device node 1: empty host path"},
		{"bad permissions", func(s *cdi.Spec) { s.Devices["w0"].DeviceNodes[0].Permissions = "rwx" }, `invalid permissions "rwx"`},
		{"bad node type", func(s *cdi.Spec) { s.Nodes["/dev/widgetw0"] = cdi.Node{Type: "z", Major: 1} }, `invalid type "z"`},
		{"empty env name", func(s *cdi.Spec) { s.Common.Env[""] = "x" }, "invalid environment variable"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w, _ := newWriter(t)
			if _, err := w.Write(widgetSpec("w0")); err != nil {
				t.Fatalf("Write: %v", err)
			}
			before, err := os.ReadFile(w.Path())
			if err != nil {
				t.Fatal(err)
			}
			s := widgetSpec("w0")
			tt.change(&s)
			_, err = w.Write(s)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Write = %v, want an error containing %q", err, tt.want)
			}
			if after, _ := os.ReadFile(w.Path()); string(after) != string(before) {
				t.Errorf("refused spec changed the file:\n%s\nwant\n%s", after, before)
			}
		})
	}
}

// A spec dir that cannot be made (here a path under a regular file, which stops root
// too) fails with the spec's path; the next Write after the fix succeeds.
func TestWriteUnwritableDir(t *testing.T) {
	parent := t.TempDir()
	blocker := filepath.Join(parent, "cdi")
	if err := os.WriteFile(blocker, []byte("not a dir"), 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := cdi.NewWriter(filepath.Join(blocker, "specs"), "devicehost-widgets")
	if err != nil {
		t.Fatalf("NewWriter: %v", err)
	}
	_, err = w.Write(widgetSpec("w0"))
	if err == nil || !strings.Contains(err.Error(), w.Path()) || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("Write = %v, want an error naming %s and why", err, w.Path())
	}
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(widgetSpec("w0")); err != nil {
		t.Fatalf("Write after the dir became writable: %v", err)
	}
	if _, err := os.Stat(w.Path()); err != nil {
		t.Errorf("spec not written: %v", err)
	}
}

// A sibling writes its own file in the same directory, each file resolving its own
// devices, and removing one leaves the other; a bad name is refused as NewWriter
// refuses it.
func TestSiblingWritesItsOwnFile(t *testing.T) {
	w, dir := newWriter(t)
	sib, err := w.Sibling("devicehost-widgets-claim-1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(widgetSpec("w0")); err != nil {
		t.Fatal(err)
	}
	if _, err := sib.Write(widgetSpec("w1")); err != nil {
		t.Fatal(err)
	}
	if got, want := sib.Path(), filepath.Join(dir, "devicehost-widgets-claim-1.yaml"); got != want {
		t.Errorf("sibling Path = %q, want %q", got, want)
	}
	if got, want := runtimeCache(t, dir).ListDevices(), []string{kind + "=w0", kind + "=w1"}; !slices.Equal(got, want) {
		t.Fatalf("devices in the spec dir = %v, want %v", got, want)
	}
	if err := sib.Remove(); err != nil {
		t.Fatal(err)
	}
	if got, want := runtimeCache(t, dir).ListDevices(), []string{kind + "=w0"}; !slices.Equal(got, want) {
		t.Fatalf("after the sibling's Remove: devices %v, want %v", got, want)
	}
	for _, bad := range []string{"", "../x", "a/b"} {
		if _, err := w.Sibling(bad); err == nil || !strings.Contains(err.Error(), "file name") {
			t.Errorf("Sibling(%q) = %v; want refused naming the file name", bad, err)
		}
	}
}

// A JSON writer (and its siblings) writes name.json, readable by every runtime and
// resolving as the YAML file does; Remove takes it away.
func TestJSONWriterResolvesLikeYAML(t *testing.T) {
	dir := t.TempDir()
	w, err := cdi.NewJSONWriter(dir, "devicehost-widgets")
	if err != nil {
		t.Fatal(err)
	}
	sib, err := w.Sibling("devicehost-widgets-claim-1")
	if err != nil {
		t.Fatal(err)
	}
	for i, x := range []*cdi.Writer{w, sib} {
		if _, err := x.Write(widgetSpec(fmt.Sprintf("w%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{filepath.Join(dir, "devicehost-widgets.json"), filepath.Join(dir, "devicehost-widgets-claim-1.json")} {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if !json.Valid(data) {
			t.Errorf("%s: not JSON: %.80q", p, data)
		}
		if m := statFile(t, p).mode; m != 0o644 {
			t.Errorf("%s: mode %v, want 0644", p, m)
		}
	}
	c := runtimeCache(t, dir)
	if got, want := c.ListDevices(), []string{kind + "=w0", kind + "=w1"}; !slices.Equal(got, want) {
		t.Fatalf("devices in the spec dir = %v, want %v", got, want)
	}
	if d := c.GetDevice(kind + "=w1"); d == nil || !slices.Contains(d.GetSpec().ContainerEdits.Env, "WIDGET_DRIVER=v2") {
		t.Errorf("device w1: not resolved with the spec's common edits: %+v", d)
	}
	if err := sib.Remove(); err != nil {
		t.Fatal(err)
	}
	if got, want := runtimeCache(t, dir).ListDevices(), []string{kind + "=w0"}; !slices.Equal(got, want) {
		t.Fatalf("after the sibling's Remove: devices %v, want %v", got, want)
	}
}

// BenchmarkWriteJSON writes a claim-sized spec (the DRA driver's, one per prepared
// claim) and removes it, on /dev/shm where it is a tmpfs (as /var/run/cdi is on a node).
func BenchmarkWriteJSON(b *testing.B) {
	dir := b.TempDir()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		if d, err := os.MkdirTemp("/dev/shm", "cdi-bench"); err == nil {
			dir = d
			b.Cleanup(func() { os.RemoveAll(d) })
		}
	}
	w, err := cdi.NewJSONWriter(dir, "devicehost.io-claim-bench")
	if err != nil {
		b.Fatal(err)
	}
	s := widgetSpec("w0", "w1")
	for b.Loop() {
		if _, err := w.Write(s); err != nil {
			b.Fatal(err)
		}
		if err := w.Remove(); err != nil {
			b.Fatal(err)
		}
	}
}

// openFDs counts this process's open descriptors (Linux), or skips the test.
func openFDs(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(es)
}

// tmpFiles lists the temporary files in dir.
func tmpFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "*.tmp"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Ahead makes the next Write's temporary file (one for a writer and its siblings)
// and closes what earlier Writes left open; the specs are written as without it;
// Discard leaves nothing behind.
func TestWriterAhead(t *testing.T) {
	dir := t.TempDir()
	w, err := cdi.NewJSONWriter(dir, "devicehost-widgets-claim-a")
	if err != nil {
		t.Fatal(err)
	}
	sib, err := w.Sibling("devicehost-widgets-claim-b")
	if err != nil {
		t.Fatal(err)
	}
	fds := openFDs(t)
	if err := w.Ahead(); err != nil {
		t.Fatal(err)
	}
	if err := sib.Ahead(); err != nil { // the same directory: still one file
		t.Fatal(err)
	}
	if got := tmpFiles(t, dir); len(got) != 1 {
		t.Fatalf("temporary files after Ahead: %v, want one", got)
	}
	for i := range 50 {
		x := []*cdi.Writer{w, sib}[i%2]
		if _, err := x.Write(widgetSpec(fmt.Sprintf("w%d", i))); err != nil {
			t.Fatal(err)
		}
		if m := statFile(t, x.Path()).mode; m != 0o644 {
			t.Errorf("%s: mode %v, want 0644", x.Path(), m)
		}
		if got := runtimeCache(t, dir).GetDevice(kind + fmt.Sprintf("=w%d", i)); got == nil {
			t.Fatalf("write %d: device w%d not in the directory's specs", i, i)
		}
		if i%3 == 0 { // now and then a Write finds no file made ahead
			if err := x.Ahead(); err != nil {
				t.Fatal(err)
			}
		}
		if n := openFDs(t) - fds; n > 2 {
			t.Fatalf("write %d: %d more descriptors open than before, want at most 2 (one ahead, one written)", i, n)
		}
	}
	// Ahead's file removed under it (a cleaned directory): the Write still lands.
	if err := w.Ahead(); err != nil {
		t.Fatal(err)
	}
	for _, f := range tmpFiles(t, dir) {
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.Write(widgetSpec("late")); err != nil {
		t.Fatalf("write after the directory was cleaned: %v", err)
	}
	if runtimeCache(t, dir).GetDevice(kind+"=late") == nil {
		t.Fatal("device late not in the directory's specs")
	}
	if err := w.Ahead(); err != nil {
		t.Fatal(err)
	}
	w.Discard()
	if got := tmpFiles(t, dir); len(got) != 0 {
		t.Errorf("temporary files after Discard: %v", got)
	}
	if n := openFDs(t) - fds; n > 0 {
		t.Errorf("%d more descriptors open after Discard", n)
	}
}

// Without a later Ahead, Writes close their own descriptors past a few.
func TestWriterAheadBoundsOpenFiles(t *testing.T) {
	dir := t.TempDir()
	w, err := cdi.NewJSONWriter(dir, "devicehost-widgets")
	if err != nil {
		t.Fatal(err)
	}
	fds := openFDs(t)
	if err := w.Ahead(); err != nil {
		t.Fatal(err)
	}
	for i := range 200 {
		if _, err := w.Write(widgetSpec(fmt.Sprintf("w%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	if n := openFDs(t) - fds; n > 16 {
		t.Errorf("%d more descriptors open after 200 Writes with no Ahead since the first, want at most 16", n)
	}
	w.Discard()
	if n := openFDs(t) - fds; n > 0 {
		t.Errorf("%d more descriptors open after Discard", n)
	}
}

// RemoveStaleTemps removes the temporary files older than its age, and leaves the
// specs, newer temporary files and other files alone.
func TestRemoveStaleTemps(t *testing.T) {
	dir := t.TempDir()
	old := time.Now().Add(-2 * time.Minute)
	write := func(name string, mtime time.Time) {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	write("spec.123.tmp", old)
	write("spec.456.tmp", time.Now())
	write("devicehost.json", old)
	write("other.tmp", old)
	n, err := cdi.RemoveStaleTemps(dir, time.Minute)
	if err != nil || n != 1 {
		t.Fatalf("RemoveStaleTemps = %d, %v; want 1 removed", n, err)
	}
	var left []string
	es, _ := os.ReadDir(dir)
	for _, e := range es {
		left = append(left, e.Name())
	}
	if want := []string{"devicehost.json", "other.tmp", "spec.456.tmp"}; !slices.Equal(left, want) {
		t.Errorf("left %v, want %v", left, want)
	}
	if n, err := cdi.RemoveStaleTemps(filepath.Join(dir, "missing"), time.Minute); n != 0 || err != nil {
		t.Errorf("missing dir: %d, %v", n, err)
	}
}
