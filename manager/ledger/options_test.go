package ledger

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// A Reserve's plugin options are the reservation's for good: they survive a reopen of
// the file and the release (the packed form), and a record without them is stored
// without the key, as older versions wrote it.
func TestPluginOptionsAreKept(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	opts := map[string]string{"mps_isolation": "per-holder", "note": "a b\\c"}
	r := res("job-1", "GPU-1")
	r.PluginOptions = maps.Clone(opts)
	a, _, err := l.Reserve(ctx, r, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.PluginOptions["mps_isolation"] = "changed by the caller" // the ledger keeps its own copy
	empty := res("job-2", "GPU-2")
	empty.PluginOptions = map[string]string{}
	b, _, err := l.Reserve(ctx, empty, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(a.PluginOptions, opts) || b.PluginOptions != nil {
		t.Errorf("Reserve answered options %v and %v; want %v and nil", a.PluginOptions, b.PluginOptions, opts)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	raw := rawRecords(t, path)
	if !strings.Contains(raw[a.ID], `"plugin_options":{"mps_isolation":"per-holder","note":"a b\\c"}`) {
		t.Errorf("record of %s = %s; want its plugin options", a.ID, raw[a.ID])
	}
	if strings.Contains(raw[b.ID], "plugin_options") {
		t.Errorf("record of %s = %s; want no plugin_options key", b.ID, raw[b.ID])
	}

	l = openLedger(t, path)
	for _, tt := range []struct {
		id   string
		want map[string]string
	}{{a.ID, opts}, {b.ID, nil}} {
		got, err := l.Get(tt.id)
		if err != nil || !maps.Equal(got.PluginOptions, tt.want) || (tt.want == nil) != (got.PluginOptions == nil) {
			t.Errorf("Get(%s) after reopen: options %#v, %v; want %#v", tt.id, got.PluginOptions, err, tt.want)
		}
	}
	live := l.Live()
	if len(live) != 2 || !maps.Equal(live[0].PluginOptions, opts) && !maps.Equal(live[1].PluginOptions, opts) {
		t.Errorf("Live after reopen = %+v; want %s with options %v", live, a.ID, opts)
	}
	release(t, l, a.ID, t0.Add(time.Minute))
	if got, err := l.Get(a.ID); err != nil || !maps.Equal(got.PluginOptions, opts) {
		t.Errorf("Get after release: options %v, %v; want %v", got.PluginOptions, err, opts)
	}
}

// A retry (same owner, exactly the devices its live reservation holds) gets the
// reservation back only with the options it was made with; with others it is refused,
// naming the reservation and both sets, from Check and from Reserve alike, and nothing
// is written.
func TestRetryWithOtherPluginOptionsIsRefused(t *testing.T) {
	l := newLedger(t)
	ctx := context.Background()
	r := res("job-1", "GPU-1", "GPU-2")
	r.PluginOptions = map[string]string{"mps_isolation": "shared"}
	first, _, err := l.Reserve(ctx, r, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		opts    map[string]string
		wantErr string // "" for the reservation back
	}{
		{"same options", map[string]string{"mps_isolation": "shared"}, ""},
		{"other value", map[string]string{"mps_isolation": "per-holder"},
			`owner "job-1": reservation ` + first.ID + ` holds the devices with plugin options {mps_isolation="shared"}, the request asks for {mps_isolation="per-holder"} (release it first, or ask with its options): plugin options differ`},
		{"none", nil,
			`owner "job-1": reservation ` + first.ID + ` holds the devices with plugin options {mps_isolation="shared"}, the request asks for {} (release it first, or ask with its options): plugin options differ`},
		{"one more", map[string]string{"mps_isolation": "shared", "x": "1\n"},
			`owner "job-1": reservation ` + first.ID + ` holds the devices with plugin options {mps_isolation="shared"}, the request asks for {mps_isolation="shared", x="1\n"} (release it first, or ask with its options): plugin options differ`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checked, cerr := l.Check("job-1", []string{"GPU-2", "GPU-1"}, nil, tt.opts, nil, nil)
			retry := res("job-1", "GPU-2", "GPU-1")
			retry.PluginOptions = tt.opts
			got, existing, rerr := l.Reserve(ctx, retry, nil, nil)
			if tt.wantErr == "" {
				if cerr != nil || checked == nil || checked.ID != first.ID || rerr != nil || !existing || got.ID != first.ID {
					t.Fatalf("Check = %v, %v; Reserve = %s, %v, %v; want %s back", checked, cerr, got.ID, existing, rerr, first.ID)
				}
				return
			}
			var de *device.OptionsDifferError
			if !errors.As(cerr, &de) || de.ReservationID != first.ID || cerr.Error() != tt.wantErr {
				t.Errorf("Check error = %v\nwant %s", cerr, tt.wantErr)
			}
			if !errors.Is(rerr, device.ErrOptionsDiffer) || rerr.Error() != "reserve: "+tt.wantErr {
				t.Errorf("Reserve error = %v\nwant reserve: %s", rerr, tt.wantErr)
			}
		})
	}
	if live := l.Live(); len(live) != 1 || live[0].ID != first.ID || live[0].PluginOptions["mps_isolation"] != "shared" {
		t.Errorf("live reservations %+v; want only %s, options unchanged", live, first.ID)
	}
}

// rawRecords returns the JSON of every reservation record in the file at path, by ID.
func rawRecords(t *testing.T, path string) map[string]string {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	out := make(map[string]string)
	err = db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketReservations).ForEach(func(k, v []byte) error {
			payload, err := unseal(v)
			if err != nil {
				return err
			}
			out[string(k)] = string(payload)
			return nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
