package ledger

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
)

// recordOf is r as a recordV1, the struct decodeReservation reads: encoding/json's
// encoding of it is what encodeReservation must write.
func recordOf(r *device.Reservation) recordV1 {
	rec := recordV1{
		ID:             r.ID,
		OwnerID:        r.OwnerID,
		Group:          groupV1{Vendor: r.Group.Vendor, Type: r.Group.Type, Name: r.Group.Name},
		Plugin:         r.Plugin,
		DeviceIDs:      r.DeviceIDs,
		Container:      containerV1{Envs: r.Container.Envs, CDIDevices: r.Container.CDIDevices},
		CreatedAt:      r.CreatedAt,
		ReleasedAt:     r.ReleasedAt,
		CleanupPending: r.CleanupPending,
		OwnerLabels:    r.OwnerLabels.Map(),
		State:          map[device.ReservationState]string{device.ReservationActive: "active", device.ReservationReleased: "released"}[r.State],
	}
	for _, c := range r.Consumes {
		rec.Consumes = append(rec.Consumes, consumptionV1{Set: c.Set.Name, Counters: c.Counters})
	}
	if r.Container.Mounts != nil {
		rec.Container.Mounts = make([]mountV1, len(r.Container.Mounts))
		for i, m := range r.Container.Mounts {
			rec.Container.Mounts[i] = mountV1(m)
		}
	}
	if r.Container.Devices != nil {
		rec.Container.Devices = make([]deviceSpecV1, len(r.Container.Devices))
		for i, d := range r.Container.Devices {
			rec.Container.Devices[i] = deviceSpecV1(d)
		}
	}
	return rec
}

// awkward are strings encoding/json escapes: quotes, backslashes, control characters,
// the HTML characters, invalid UTF-8, U+2028/U+2029, and plain multi-byte text.
var awkward = []string{
	"", "GPU-0", `a"b\c`, "\b\f\n\r\t\x00\x01\x1f\x7f", "<script>&amp;</script>",
	"\xff\xfe", "caf\xc3", "line\u2028sep\u2029", "héllo wörld ✓ 🚀", "\xed\xa0\x80",
	strings.Repeat("x", 300),
}

// randomReservation fills every field of a reservation from rng, with awkward strings.
func randomReservation(rng *rand.Rand) *device.Reservation {
	str := func() string {
		if rng.IntN(3) == 0 {
			return awkward[rng.IntN(len(awkward))]
		}
		b := make([]byte, rng.IntN(12))
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		return string(b)
	}
	strs := func() []string {
		switch rng.IntN(4) {
		case 0:
			return nil
		case 1:
			return []string{}
		}
		s := make([]string, 1+rng.IntN(4))
		for i := range s {
			s[i] = str()
		}
		return s
	}
	r := &device.Reservation{
		ID: str(), OwnerID: str(), Plugin: str(),
		Group:     device.GroupKey{Vendor: str(), Type: str(), Name: str()},
		DeviceIDs: strs(),
		Container: device.ContainerReservation{CDIDevices: strs()},
		State:     device.ReservationActive,
		CreatedAt: time.Unix(rng.Int64N(1<<35), rng.Int64N(1e9)).UTC(),
	}
	if rng.IntN(2) == 0 {
		r.State, r.ReleasedAt, r.CleanupPending = device.ReservationReleased, time.Unix(rng.Int64N(1<<35), 0).UTC(), rng.IntN(2) == 0
	}
	if rng.IntN(4) > 0 {
		r.Container.Envs = map[string]string{}
		for range rng.IntN(5) {
			r.Container.Envs[str()] = str()
		}
	}
	if rng.IntN(3) > 0 {
		r.Container.Mounts = make([]device.Mount, rng.IntN(3))
		for i := range r.Container.Mounts {
			r.Container.Mounts[i] = device.Mount{HostPath: str(), ContainerPath: str(), ReadOnly: rng.IntN(2) == 0}
		}
	}
	if rng.IntN(3) > 0 {
		r.Container.Devices = make([]device.DeviceSpec, rng.IntN(3))
		for i := range r.Container.Devices {
			r.Container.Devices[i] = device.DeviceSpec{HostPath: str(), ContainerPath: str(), Permissions: str()}
		}
	}
	for range rng.IntN(3) {
		c := device.Consumption{Set: device.CounterSetKey{Plugin: r.Plugin, Name: str()}}
		if rng.IntN(4) > 0 {
			c.Counters = map[string]int64{}
			for range rng.IntN(4) {
				c.Counters[str()] = rng.Int64() - rng.Int64()
			}
		}
		r.Consumes = append(r.Consumes, c)
	}
	switch rng.IntN(4) {
	case 1:
		r.OwnerLabels.Pod = str()
	case 2:
		r.OwnerLabels.Namespace = str()
	case 3:
		r.OwnerLabels = device.OwnerLabels{Pod: str(), Namespace: str()}
	}
	return r
}

// TestRecordJSONIsEncodingJSONs: the hand-written record encoder writes, byte for byte,
// what json.Marshal writes of the same recordV1, so records written before and after
// it read back alike, whatever the strings hold.
func TestRecordJSONIsEncodingJSONs(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 5000 {
		r := randomReservation(rng)
		got, err := encodeReservation(r)
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		want, err := json.Marshal(recordOf(r))
		if err != nil {
			t.Fatalf("record %d: json.Marshal: %v", i, err)
		}
		if !bytes.Equal(got, seal(want)) {
			t.Fatalf("record %d:\n got %s\nwant %s", i, got[4:], want)
		}
	}
}

// FuzzRecordJSONString: any string is quoted as encoding/json quotes it.
func FuzzRecordJSONString(f *testing.F) {
	for _, s := range awkward {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		if got := appendJSONString(nil, s); !bytes.Equal(got, want) {
			t.Errorf("appendJSONString(%q) = %s, want %s", s, got, want)
		}
	})
}

// TestRecordJSONRefusesWhatJSONRefuses: a time encoding/json cannot write (a year past
// 9999) and an unknown state are errors naming the reservation, not a record.
func TestRecordJSONRefusesWhatJSONRefuses(t *testing.T) {
	r := &device.Reservation{ID: "r1", OwnerID: "o", DeviceIDs: []string{"d"}, State: device.ReservationActive,
		CreatedAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}
	if _, err := encodeReservation(r); err == nil || !strings.Contains(err.Error(), `"r1": created_at`) {
		t.Errorf("year 10000: err = %v, want one naming r1's created_at", err)
	}
	if _, err := json.Marshal(recordOf(r)); err == nil {
		t.Error("json.Marshal wrote year 10000: the two encoders no longer agree")
	}
	r.CreatedAt, r.State = time.Unix(0, 0).UTC(), device.ReservationState(99)
	if _, err := encodeReservation(r); err == nil || !strings.Contains(err.Error(), `"r1": cannot store state`) {
		t.Errorf("state 99: err = %v, want one naming r1's state", err)
	}
}

// BenchmarkEncodeReservation: one record of a GPU reservation as the nvidia-example
// plugin answers it (envs, device nodes, a CDI device, counters), hand-written against
// encoding/json.
func BenchmarkEncodeReservation(b *testing.B) {
	r := &device.Reservation{
		ID: "4f1c2a9be0d37a65", OwnerID: "k8s-claim/ml/train-0/3b9c1d2e", Plugin: "nvidia-example",
		Group:     device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100-80GB"},
		DeviceIDs: []string{"GPU-0a1b2c3d-0000-0000-0000-000000000000"},
		Container: device.ContainerReservation{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-0a1b2c3d-0000-0000-0000-000000000000",
				"DEVICEHOST_RESERVATION_ID": "4f1c2a9be0d37a65", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
			Devices: []device.DeviceSpec{{HostPath: "/dev/nvidia0", ContainerPath: "/dev/nvidia0", Permissions: "rw"},
				{HostPath: "/dev/nvidiactl", ContainerPath: "/dev/nvidiactl", Permissions: "rw"},
				{HostPath: "/dev/nvidia-uvm", ContainerPath: "/dev/nvidia-uvm", Permissions: "rw"}},
			CDIDevices: []string{"nvidia.com/gpu=GPU-0a1b2c3d-0000-0000-0000-000000000000"},
		},
		Consumes:    []device.Consumption{{Set: device.CounterSetKey{Name: "gpu-0"}, Counters: map[string]int64{"memory": 80, "slices": 7}}},
		State:       device.ReservationReleased,
		CreatedAt:   time.Date(2026, 12, 5, 10, 0, 0, 123456789, time.UTC),
		ReleasedAt:  time.Date(2026, 12, 5, 10, 0, 1, 0, time.UTC),
		OwnerLabels: device.OwnerLabels{Pod: "train-0", Namespace: "ml"},
	}
	b.Run("hand-written", func(b *testing.B) {
		for b.Loop() {
			if _, err := encodeReservation(r); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		for b.Loop() {
			v, err := json.Marshal(recordOf(r))
			if err != nil {
				b.Fatal(err)
			}
			_ = seal(v)
		}
	})
}
