package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/gc"
	"github.com/devicehost/devicehost/manager/ledger"
)

// The manager's path through the ledger: check before asking the plugin, commit the
// plugin's answer, release, and let a GC run the plugin cleanup and collect.
func Example() {
	dir, _ := os.MkdirTemp("", "ledger-example")
	defer os.RemoveAll(dir)
	l, err := ledger.Open(filepath.Join(dir, ledger.DefaultFileName), ledger.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer l.Close()
	ctx := context.Background()

	// Before calling the plugin: is the request free, a retry, or a conflict?
	if prior, err := l.Check("alloc-1", []string{"GPU-a", "GPU-b"}, nil, nil, nil, nil); err != nil || prior != nil {
		fmt.Println("not new:", prior, err)
		return
	}
	// The plugin answered; record it. It is fsynced when Reserve returns.
	r, existing, err := l.Reserve(ctx, device.Reservation{
		ID:        "res-example",
		OwnerID:   "alloc-1",
		Plugin:    "nvidia-example",
		DeviceIDs: []string{"GPU-a", "GPU-b"},
		Container: device.ContainerReservation{Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}},
	}, nil, nil)
	fmt.Println(r.ID, existing, err)

	// A retry by the same owner gets the same reservation; another owner is refused.
	r2, existing, _ := l.Reserve(ctx, device.Reservation{OwnerID: "alloc-1", DeviceIDs: []string{"GPU-b", "GPU-a"}}, nil, nil)
	fmt.Println(r2.ID, existing)
	_, _, err = l.Reserve(ctx, device.Reservation{OwnerID: "alloc-2", DeviceIDs: []string{"GPU-b"}}, nil, nil)
	fmt.Println(errors.Is(err, device.ErrDeviceHeld), err)
	h := l.Holders()["GPU-a"]
	fmt.Println(h.ReservationID, h.OwnerID)

	// Release: the devices are free at once, the plugin cleanup is owed.
	released, _, _ := l.Release(ctx, device.ReleaseRequest{OwnerID: "alloc-1"}, time.Time{})
	fmt.Println(len(released), released[0].State, released[0].CleanupPending)

	// The GC does the cleanup (and, past MaxReservations or on Interval, deletes).
	cleaned := make(chan string, 1)
	collector, _ := gc.New(l, gc.Config{Cleanup: func(ctx context.Context, e gc.Entry) error {
		cleaned <- e.OwnerID + " " + e.ReservationID
		return nil
	}})
	gcCtx, stop := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- collector.Run(gcCtx) }()
	fmt.Println("cleaned up", <-cleaned)
	stop()
	<-done

	// Output:
	// res-example false <nil>
	// res-example true
	// true reserve: owner "alloc-2": GPU-b held by reservation res-example of owner "alloc-1": device held
	// res-example alloc-1
	// 1 released true
	// cleaned up alloc-1 res-example
}
