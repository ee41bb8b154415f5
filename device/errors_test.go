package device_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// Holders is Error without the requesting owner and the sentinel, and words each kind
// of holder: another owner's reservation, a Reserve in flight, the owner's own.
func TestHeldErrorHolders(t *testing.T) {
	e := &device.HeldError{OwnerID: "a", Conflicts: []device.Conflict{
		{Holder: device.Holder{ReservationID: "res-1", OwnerID: "b"}, Overlap: []string{"GPU-0", "GPU-1"}, Held: []string{"GPU-0", "GPU-1"}},
		{Holder: device.Holder{ReservationID: "res-2", OwnerID: "a"}, Overlap: []string{"GPU-2"}, Held: []string{"GPU-2", "GPU-3"}},
		{Holder: device.Holder{OwnerID: "c"}, Overlap: []string{"GPU-4"}, Held: []string{"GPU-4"}},
	}}
	want := `GPU-0, GPU-1 held by reservation res-1 of owner "b"; ` +
		`GPU-2 overlap reservation res-2 of the same owner, which holds GPU-2, GPU-3 ` +
		`(a retry must ask for exactly the devices reserved, or release them first); ` +
		`GPU-4 being reserved for owner "c"`
	if got := e.Holders(); got != want {
		t.Errorf("Holders() = %q\nwant %q", got, want)
	}
	if got, want := e.Error(), fmt.Sprintf("owner %q: %s: %v", "a", want, device.ErrDeviceHeld); got != want {
		t.Errorf("Error() = %q\nwant %q", got, want)
	}
	if !errors.Is(e, device.ErrDeviceHeld) {
		t.Error("a HeldError is not ErrDeviceHeld")
	}
}

// Counters is Error without the requesting owner and the sentinel, and names at most
// two counters and three users of each, counting the rest.
func TestCapacityErrorCounters(t *testing.T) {
	set := device.CounterSetKey{Plugin: "nvidia", Name: "GPU-0"}
	var users []device.Holder
	for i := range 5 {
		users = append(users, device.Holder{ReservationID: fmt.Sprintf("res-%d", i), OwnerID: fmt.Sprintf("o%d", i)})
	}
	e := &device.CapacityError{OwnerID: "a", Overruns: []device.Overrun{
		{Set: set, Counter: "compute-slices", Capacity: 7, Used: 7, Requested: 1, Users: users},
		{Set: set, Counter: "memory-slice-0", Capacity: 1, Used: 0, Requested: 2},
		{Set: set, Counter: "memory-slice-1", Capacity: 1, Used: 1, Requested: 1, Users: users[:1]},
		{Set: set, Counter: "memory-slice-2", Capacity: 1, Used: 1, Requested: 1, Users: users[:1]},
	}}
	want := `counter "compute-slices" of set "GPU-0" (plugin "nvidia"): 1 requested, 7 of 7 used by ` +
		`reservation res-0 of owner "o0", reservation res-1 of owner "o1", reservation res-2 of owner "o2", 2 more; ` +
		`counter "memory-slice-0" of set "GPU-0" (plugin "nvidia"): 2 requested, 0 of 1 used; ` +
		`and 2 more counters`
	if got := e.Counters(); got != want {
		t.Errorf("Counters() = %q\nwant %q", got, want)
	}
	if got, want := e.Error(), fmt.Sprintf("owner %q: %s: %v", "a", want, device.ErrCapacityExceeded); got != want {
		t.Errorf("Error() = %q\nwant %q", got, want)
	}
	if !errors.Is(e, device.ErrCapacityExceeded) {
		t.Error("a CapacityError is not ErrCapacityExceeded")
	}
}
