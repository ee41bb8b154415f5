package ledger

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
)

// A record written by encodeReservation reads back as the same reservation, strings
// encoding/json must escape included.
func TestRecordRoundTrip(t *testing.T) {
	for _, s := range []string{"", "GPU-0", `a"b\c`, "\b\f\n\r\t\x00\x1f\x7f", "<script>&amp;</script>", "line\u2028sep", "héllo ✓ 🚀"} {
		r := &device.Reservation{
			ID: "res-1", OwnerID: "o" + s, Plugin: "p", Group: device.GroupKey{Vendor: "v", Type: s, Name: "n"},
			DeviceIDs: []string{"d0", "d1" + s},
			Container: device.ContainerReservation{Envs: map[string]string{"K": s}, CDIDevices: []string{"v.com/x=" + s},
				Mounts:  []device.Mount{{HostPath: "/h", ContainerPath: "/c" + s, ReadOnly: true}},
				Devices: []device.DeviceSpec{{HostPath: "/dev/x", ContainerPath: "/dev/y", Permissions: "rw"}}},
			Consumes:    []device.Consumption{{Set: device.CounterSetKey{Plugin: "p", Name: "gpu-0"}, Counters: map[string]int64{"memory": 80}}},
			State:       device.ReservationReleased,
			CreatedAt:   time.Date(2026, 12, 5, 10, 0, 0, 123456789, time.UTC),
			ReleasedAt:  time.Date(2026, 12, 5, 10, 0, 1, 0, time.UTC),
			OwnerLabels: device.OwnerLabels{Pod: "train-0", Namespace: "ml"},
		}
		v, err := encodeReservation(r)
		if err != nil {
			t.Fatal(err)
		}
		got, err := decodeReservation([]byte(r.ID), v)
		if err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		if !reflect.DeepEqual(got, r) {
			t.Errorf("%q: read back %+v, want %+v", s, got, r)
		}
	}
}

// A time encoding/json cannot write (a year past 9999) and an unknown state are errors
// naming the reservation, not a record.
func TestRecordRefusesWhatItCannotHold(t *testing.T) {
	r := &device.Reservation{ID: "r1", OwnerID: "o", DeviceIDs: []string{"d"}, State: device.ReservationActive,
		CreatedAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}
	if _, err := encodeReservation(r); err == nil || !strings.Contains(err.Error(), `"r1"`) {
		t.Errorf("year 10000: err = %v, want one naming r1", err)
	}
	r.CreatedAt, r.State = time.Unix(0, 0).UTC(), device.ReservationState(99)
	if _, err := encodeReservation(r); err == nil || !strings.Contains(err.Error(), `"r1": cannot store state`) {
		t.Errorf("state 99: err = %v, want one naming r1's state", err)
	}
}
