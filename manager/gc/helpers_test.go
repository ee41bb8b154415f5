package gc

import (
	"context"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/tools/logtest"
	"github.com/hashicorp/go-hclog"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// t0 is the release time the tests start from.
var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// statePath is a fresh state file path in the test's temp dir.
func statePath(t *testing.T) string { return filepath.Join(t.TempDir(), ledger.DefaultFileName) }

// openLedger opens the ledger at path, without its trail, closed at cleanup. Its clock
// moves a second at each reading, so that reservations made one after another list in
// that order.
func openLedger(t *testing.T, path string) *ledger.Ledger {
	t.Helper()
	var n atomic.Int64
	clock := func() time.Time { return t0.Add(time.Duration(n.Add(1)) * time.Second) }
	l, err := ledger.Open(path, ledger.Options{MaxEvents: -1, Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// newLedger is openLedger on a fresh state file.
func newLedger(t *testing.T) *ledger.Ledger { return openLedger(t, statePath(t)) }

// res is a reservation of owner for devs, as a plugin of the "acme" group answers it.
func res(owner string, devs ...string) device.Reservation {
	return device.Reservation{OwnerID: owner, Plugin: "nvidia-example", DeviceIDs: devs,
		Group:     device.GroupKey{Vendor: "acme", Type: "gpu", Name: "A1"},
		Container: device.ContainerReservation{Envs: map[string]string{"ACME_DEVICES": devs[0]}}}
}

// reserve makes a new live reservation of owner for devs, or fails the test.
func reserve(t *testing.T, l *ledger.Ledger, owner string, devs ...string) device.Reservation {
	t.Helper()
	r, existing, err := l.Reserve(context.Background(), res(owner, devs...), nil, nil)
	if err != nil || existing {
		t.Fatalf("Reserve of %v by %s: existing %v, %v", devs, owner, existing, err)
	}
	return r
}

// release releases reservation id at at, or fails the test.
func release(t *testing.T, l *ledger.Ledger, id string, at time.Time) device.Reservation {
	t.Helper()
	done, _, err := l.Release(context.Background(), device.ReleaseRequest{ReservationID: id}, at)
	if err != nil || len(done) != 1 {
		t.Fatalf("Release of %s: %v, %v", id, done, err)
	}
	return done[0]
}

// listAll is every reservation the ledger lists.
func listAll(t *testing.T, l *ledger.Ledger) []device.Reservation {
	t.Helper()
	rs, err := l.List(context.Background(), device.ReservationFilter{})
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// ids are the IDs of rs, in order.
func ids(rs []device.Reservation) []string {
	out := make([]string, 0, len(rs))
	for _, r := range rs {
		out = append(out, r.ID)
	}
	return out
}

// newLogCapture returns a JSON logger at DEBUG and the recorder of what it logs.
func newLogCapture() (*logtest.Recorder, hclog.Logger) {
	rec := &logtest.Recorder{}
	return rec, hclog.New(&hclog.LoggerOptions{Output: rec, Level: hclog.Debug, JSONFormat: true})
}

// logged returns the lines rec holds whose message is msg, or starts with it when
// prefix.
func logged(t *testing.T, rec *logtest.Recorder, msg string, prefix bool) []map[string]any {
	t.Helper()
	all, err := rec.JSON()
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for _, m := range all {
		if got, _ := m["@message"].(string); got == msg || prefix && strings.HasPrefix(got, msg) {
			out = append(out, m)
		}
	}
	return out
}
