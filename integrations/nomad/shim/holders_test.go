package shim

import (
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/integrations/nomad/nomadapi"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

// alloc is an allocation of job "train" whose task "main" holds devices.
func alloc(id, status string, createIndex uint64, devices ...string) nomadapi.Allocation {
	return nomadapi.Allocation{ID: id, Namespace: "ml", JobID: "train", ClientStatus: status, CreateIndex: createIndex,
		AllocatedResources: &nomadapi.AllocatedResources{Tasks: map[string]*nomadapi.AllocatedTaskResources{
			"main": {Devices: []*nomadapi.AllocatedDeviceResource{{Vendor: "nvidia", Type: "gpu", Name: "H100", DeviceIDs: devices}}},
		}}}
}

func res(id, owner string, created time.Time, devices ...string) *pb.Reservation {
	return &pb.Reservation{ReservationId: id, OwnerId: owner, DeviceIds: devices, State: pb.ReservationState_RESERVATION_STATE_ACTIVE,
		CreatedAt: timestamppb.New(created)}
}

// actions writes actions as "reown res=owner" or "release res".
func actions(acts []action) []string {
	var out []string
	for _, a := range acts {
		switch a.kind {
		case actReown:
			out = append(out, "reown "+a.res.GetReservationId()+"="+a.newOwner)
		case actRelease:
			out = append(out, "release "+a.res.GetReservationId())
		}
	}
	return out
}

// One pass of decisions, reservation by reservation.
func TestDecide(t *testing.T) {
	const grace = 30 * time.Second
	issued := t0.Add(time.Second) // the view was asked for after the reservations were made
	owner := func(id string) string { return AllocOwner("ml", "train", id, "main") }
	for _, tc := range []struct {
		name   string
		allocs []nomadapi.Allocation
		rs     []*pb.Reservation
		want   []string
	}{
		{"a Reserve's owner is handed to the running task",
			[]nomadapi.Allocation{alloc("A", "running", 5, "GPU-a", "GPU-b")},
			[]*pb.Reservation{res("r1", "nomad/RANDOM", t0, "GPU-a", "GPU-b")},
			[]string{"reown r1=" + owner("A")}},
		{"pending and unknown allocations hold their devices too",
			[]nomadapi.Allocation{alloc("A", "pending", 5, "GPU-a"), alloc("B", "unknown", 6, "GPU-b")},
			[]*pb.Reservation{res("r1", "nomad/R1", t0, "GPU-a"), res("r2", "nomad/R2", t0, "GPU-b")},
			[]string{"reown r1=" + owner("A"), "reown r2=" + owner("B")}},
		{"the task with exactly its devices, then the newest allocation",
			[]nomadapi.Allocation{alloc("old", "running", 5, "GPU-a"), alloc("exact", "running", 6, "GPU-a", "GPU-b"), alloc("new", "running", 7, "GPU-b")},
			[]*pb.Reservation{res("r1", "nomad/R1", t0, "GPU-b", "GPU-a"), res("r2", "nomad/R2", t0, "GPU-b")},
			[]string{"reown r1=" + owner("exact"), "reown r2=" + owner("new")}},
		{"a reservation already named is left as it is",
			[]nomadapi.Allocation{alloc("A", "running", 5, "GPU-a")},
			[]*pb.Reservation{res("r1", owner("A"), t0, "GPU-a")},
			nil},
		{"one named after an ended allocation whose devices a running one holds is kept, not renamed",
			[]nomadapi.Allocation{alloc("A", "complete", 5, "GPU-a"), alloc("B", "pending", 6, "GPU-a")},
			[]*pb.Reservation{res("r1", owner("A"), t0, "GPU-a")},
			nil},
		{"a reservation made after Nomad was asked is not judged",
			nil,
			[]*pb.Reservation{res("r1", "nomad/R1", issued, "GPU-a"), res("r2", "nomad/R2", issued.Add(time.Second), "GPU-b")},
			nil},
		{"other owners are not the shim's",
			nil,
			[]*pb.Reservation{res("r1", "k8s/ml/p/c", t0, "GPU-a"), res("r2", "job-7", t0, "GPU-b"), res("r3", "nomadic/x", t0, "GPU-c")},
			nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTracker(grace)
			v := &nomadView{issued: issued, allocs: tc.allocs}
			for _, now := range []time.Time{issued, issued.Add(grace), issued.Add(10 * grace)} {
				acts, _ := tr.decide(v, tc.rs, now)
				if got := actions(acts); !reflect.DeepEqual(got, tc.want) {
					t.Errorf("at +%v: %q, want %q", now.Sub(issued), got, tc.want)
				}
			}
		})
	}
}

// A reservation no allocation the client runs holds (complete, failed, lost, or
// gone) is released once that has lasted the grace period, and not before; one held
// again meanwhile starts over.
func TestDecideReleasesAfterGrace(t *testing.T) {
	const grace = 30 * time.Second
	for _, status := range []string{"complete", "failed", "lost", "gone"} {
		t.Run(status, func(t *testing.T) {
			tr := newTracker(grace)
			var allocs []nomadapi.Allocation
			if status != "gone" {
				allocs = append(allocs, alloc("A", status, 5, "GPU-a", "GPU-b"))
			}
			rs := []*pb.Reservation{res("r1", AllocOwner("ml", "train", "A", "main"), t0, "GPU-a", "GPU-b")}
			v := &nomadView{issued: t0.Add(time.Second), allocs: allocs}
			now := t0.Add(2 * time.Second)
			acts, next := tr.decide(v, rs, now)
			if len(acts) != 0 || !next.Equal(now.Add(grace)) {
				t.Fatalf("first pass: %q, next %v; want nothing, next at +grace", actions(acts), next)
			}
			if acts, _ := tr.decide(v, rs, now.Add(grace-time.Millisecond)); len(acts) != 0 {
				t.Fatalf("before the grace ended: %q", actions(acts))
			}
			acts, next = tr.decide(v, rs, now.Add(grace))
			if got := actions(acts); !reflect.DeepEqual(got, []string{"release r1"}) || !next.IsZero() {
				t.Fatalf("at the grace's end: %q, next %v; want release r1", got, next)
			}
			wantWhy := "no allocation on this node holds its devices"
			if status != "gone" {
				wantWhy = "allocation ended: " + AllocOwner("ml", "train", "A", "main") + " (" + status + ")"
			}
			if acts[0].why != wantWhy || acts[0].freeFor != grace {
				t.Errorf("why %q, free for %v; want %q, %v", acts[0].why, acts[0].freeFor, wantWhy, grace)
			}
		})
	}

	t.Run("held again", func(t *testing.T) {
		tr := newTracker(grace)
		rs := []*pb.Reservation{res("r1", "nomad/R1", t0, "GPU-a")}
		free := &nomadView{issued: t0.Add(time.Second)}
		held := &nomadView{issued: t0.Add(time.Second), allocs: []nomadapi.Allocation{alloc("B", "pending", 9, "GPU-a")}}
		tr.decide(free, rs, t0.Add(time.Second))
		tr.decide(held, rs, t0.Add(20*time.Second))
		if acts, _ := tr.decide(free, rs, t0.Add(40*time.Second)); len(acts) != 0 {
			t.Errorf("free 20 s after being held again: %q; want nothing yet", actions(acts))
		}
		if acts, _ := tr.decide(free, rs, t0.Add(70*time.Second)); !reflect.DeepEqual(actions(acts), []string{"release r1"}) {
			t.Errorf("free 30 s after being held again: %q", actions(acts))
		}
	})

	t.Run("forgets reservations gone from the agent", func(t *testing.T) {
		tr := newTracker(grace)
		v := &nomadView{issued: t0.Add(time.Second)}
		tr.decide(v, []*pb.Reservation{res("r1", "nomad/R1", t0, "GPU-a")}, t0.Add(time.Second))
		tr.decide(v, nil, t0.Add(2*time.Second))
		if len(tr.bookings) != 0 {
			t.Errorf("bookings %v; want none", tr.bookings)
		}
	})
}

func TestIsReserveOwner(t *testing.T) {
	for owner, want := range map[string]bool{
		"nomad/ABCDEF": true, "nomad/": false, "nomad/ml/train/a/main": false, "k8s/x": false, "nomadX": false,
	} {
		if got := isReserveOwner(owner); got != want {
			t.Errorf("isReserveOwner(%q) = %v, want %v", owner, got, want)
		}
	}
}
