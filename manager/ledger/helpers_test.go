package ledger

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/tools/logtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// t0 is a fixed clock reading for tests that compare times.
var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// statePath returns a fresh state file path in a test's temp dir.
func statePath(t *testing.T) string {
	t.Helper()
	return filepath.Join(t.TempDir(), DefaultFileName)
}

// openLedger opens the ledger at path, on a tickingClock, and closes it when the test
// ends.
func openLedger(t *testing.T, path string) *Ledger {
	t.Helper()
	// No audit trail: events_test.go opens ledgers with it.
	return openWith(t, path, Options{MaxEvents: -1})
}

// openWith opens the ledger at path with opts (a tickingClock when opts.Now is nil) and
// closes it when the test ends.
func openWith(t *testing.T, path string, opts Options) *Ledger {
	t.Helper()
	if opts.Now == nil {
		opts.Now = tickingClock()
	}
	l, err := Open(path, opts)
	if err != nil {
		t.Fatalf("Open(%s): %v", path, err)
	}
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return l
}

// newLedger opens a ledger on a fresh state file.
func newLedger(t *testing.T) *Ledger {
	t.Helper()
	return openLedger(t, statePath(t))
}

// res returns a reservation request of owner for devs, with a full container answer so
// that round trips through the file cover every field.
func res(owner string, devs ...string) device.Reservation {
	return device.Reservation{
		OwnerID:   owner,
		Group:     device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100"},
		Plugin:    "nvidia-example",
		DeviceIDs: devs,
		Container: device.ContainerReservation{
			Envs:       map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(devs, ",")},
			Mounts:     []device.Mount{{HostPath: "/usr/lib/x", ContainerPath: "/usr/lib/x", ReadOnly: true}},
			Devices:    []device.DeviceSpec{{HostPath: "/dev/nvidia0", ContainerPath: "/dev/nvidia0", Permissions: "rw"}},
			CDIDevices: []string{"nvidia.com/gpu=" + devs[0]},
		},
	}
}

// tickingClock returns a clock that reads t0, then one second later on each call, so
// that reservations made one after another sort in that order.
func tickingClock() func() time.Time {
	var n atomic.Int64
	return func() time.Time { return t0.Add(time.Duration(n.Add(1)) * time.Second) }
}

// settableClock is a clock that stays at t0 until advance moves it on. Safe for
// concurrent use.
func settableClock() (clock func() time.Time, advance func(time.Duration)) {
	var mu sync.Mutex
	now := t0
	return func() time.Time {
			mu.Lock()
			defer mu.Unlock()
			return now
		}, func(d time.Duration) {
			mu.Lock()
			now = now.Add(d)
			mu.Unlock()
		}
}

// reserve reserves a new reservation of owner for devs and fails the test otherwise.
func reserve(t *testing.T, l *Ledger, owner string, devs ...string) device.Reservation {
	t.Helper()
	r, existing, err := l.Reserve(context.Background(), res(owner, devs...), nil, nil)
	if err != nil || existing {
		t.Fatalf("Reserve(%s, %v) = existing %v, err %v; want a new reservation", owner, devs, existing, err)
	}
	return r
}

func release(t *testing.T, l *Ledger, id string, at time.Time) device.Reservation {
	t.Helper()
	rs, already, err := l.Release(context.Background(), device.ReleaseRequest{ReservationID: id}, at)
	if err != nil || len(rs) != 1 || len(already) != 0 {
		t.Fatalf("Release(%s) = %v, %v, %v; want one reservation released now", id, rs, already, err)
	}
	return rs[0]
}

func listAll(t *testing.T, l *Ledger) []device.Reservation {
	t.Helper()
	rs, err := l.List(context.Background(), device.ReservationFilter{})
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	return rs
}

func ids(rs []device.Reservation) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.ID
	}
	return out
}

// logCapture records an hclog logger's JSON lines.
type logCapture struct{ logtest.Recorder }

func newLogCapture() (*logCapture, hclog.Logger) {
	c := &logCapture{}
	return c, hclog.New(&hclog.LoggerOptions{Output: c, Level: hclog.Debug, JSONFormat: true})
}
