package ledger

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// openWithEvents opens a fresh ledger with opts (its audit trail on, unlike
// newLedger's), closed at cleanup.
func openWithEvents(t *testing.T, opts Options) *Ledger {
	t.Helper()
	l, err := Open(statePath(t), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// allEvents reads the whole trail after seq.
func allEvents(t *testing.T, l *Ledger, f device.EventFilter) []device.Event {
	t.Helper()
	var out []device.Event
	for {
		page, err := l.Events(context.Background(), f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, page.Events...)
		if page.Through == f.After {
			return out
		}
		f.After = page.Through
	}
}

// brief is an event without its time and position, to compare.
func brief(e device.Event) string {
	return fmt.Sprintf("%s by=%q call=%q owner=%q new=%q devices=%v reservations=%v detail=%q",
		e.Kind, e.By, e.Call, e.Owner, e.NewOwner, e.Devices, e.Reservations, e.Detail)
}

// Every change is an event, in commit order, with who made it, and costs its Reserve no
// commit of its own; a refused call is an event too.
func TestEveryChangeIsAnEvent(t *testing.T) {
	l := openWithEvents(t, Options{Now: tickingClock()})
	ctx := device.WithCaller(context.Background(), `listener "main" uid=0,gid=0,pid=1`)
	bridge := device.WithCaller(context.Background(), `listener "bridge" uid=0,gid=0,pid=2`)
	commits := l.Commits()

	a, _, err := l.Reserve(ctx, res("job/a", "GPU-0"), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := l.Commits() - commits; got != 1 {
		t.Errorf("a Reserve with its event made %d commits, want 1", got)
	}
	b, _, err := l.Reserve(bridge, res("job/b", "GPU-0", "GPU-1"), []string{"job/"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Reserve(ctx, res("other", "GPU-1"), nil, nil); err == nil {
		t.Fatal("a Reserve of a held device succeeded")
	}
	if _, err := l.Reown(bridge, device.ReownRequest{ReservationID: b.ID, OwnerID: "job/b", NewOwnerID: "job/c"}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Cordon(ctx, "GPU-2", device.Cordon{Reason: "ECC storm", By: "x", Drain: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Uncordon(ctx, "GPU-2"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Release(bridge, device.ReleaseRequest{OwnerID: "job/c"}, time.Time{}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.submit(context.Background(), deleteRun([]string{a.ID, b.ID}, true, "gc")); err != nil {
		t.Fatal(err)
	}

	events := allEvents(t, l, device.EventFilter{})
	var got []string
	for i, e := range events {
		got = append(got, brief(e))
		if i > 0 && e.Seq <= events[i-1].Seq {
			t.Errorf("event %d has seq %d after %d", i, e.Seq, events[i-1].Seq)
		}
		if e.Time.IsZero() {
			t.Errorf("event %d has no time", e.Seq)
		}
	}
	main, br := `listener "main" uid=0,gid=0,pid=1`, `listener "bridge" uid=0,gid=0,pid=2`
	want := []string{
		brief(device.Event{Kind: device.EventReserve, By: main, Owner: "job/a", Devices: []string{"GPU-0"}, Reservations: []string{a.ID}}),
		brief(device.Event{Kind: device.EventTakeOver, By: br, Owner: "job/a", Devices: []string{"GPU-0"}, Reservations: []string{a.ID},
			Detail: fmt.Sprintf("taken over by reservation %s of owner \"job/b\"", b.ID)}),
		brief(device.Event{Kind: device.EventReserve, By: br, Owner: "job/b", Devices: []string{"GPU-0", "GPU-1"}, Reservations: []string{b.ID}}),
		// The refusal rides on the next commit, ahead of its write.
		brief(device.Event{Kind: device.EventRefused, By: main, Call: "reserve", Owner: "other", Devices: []string{"GPU-1"},
			Detail: fmt.Sprintf("owner %q: GPU-1 held by reservation %s of owner %q: device held", "other", b.ID, "job/b")}),
		brief(device.Event{Kind: device.EventReown, By: br, Owner: "job/b", NewOwner: "job/c", Devices: []string{"GPU-0", "GPU-1"}, Reservations: []string{b.ID}}),
		brief(device.Event{Kind: device.EventCordon, By: main, Devices: []string{"GPU-2"}, Detail: "drain: ECC storm"}),
		brief(device.Event{Kind: device.EventUncordon, By: main, Devices: []string{"GPU-2"}, Detail: "was: ECC storm"}),
		brief(device.Event{Kind: device.EventRelease, By: br, Owner: "job/c", Devices: []string{"GPU-0", "GPU-1"}, Reservations: []string{b.ID}}),
		brief(device.Event{Kind: device.EventDelete, By: "gc", Devices: []string{"GPU-0", "GPU-0", "GPU-1"}, Reservations: []string{a.ID, b.ID}}),
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("events:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// Filters: an owner (prefix), a device.
	if got := allEvents(t, l, device.EventFilter{Owner: "job/c"}); len(got) != 2 || got[0].Kind != device.EventReown || got[1].Kind != device.EventRelease {
		t.Errorf("events of job/c: %v", got)
	}
	if got := allEvents(t, l, device.EventFilter{Device: "GPU-2"}); len(got) != 2 {
		t.Errorf("events of GPU-2: %v", got)
	}
	if got := allEvents(t, l, device.EventFilter{After: events[6].Seq}); len(got) != 2 {
		t.Errorf("events after %d: %v, want the last 2", events[6].Seq, got)
	}
}

// The trail keeps its newest MaxEvents, its positions go on increasing across a reopen
// (a consumer resumes where it was), and Oldest says what was dropped.
func TestEventsBoundedAndResumable(t *testing.T) {
	ctx := context.Background()
	path := statePath(t)
	l, err := Open(path, Options{MaxEvents: 5})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 8 {
		reserve(t, l, fmt.Sprintf("job-%d", i), fmt.Sprintf("GPU-%d", i))
	}
	page, err := l.Events(ctx, device.EventFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Events) != 5 || page.Events[0].Owner != "job-3" || page.Oldest != page.Events[0].Seq {
		t.Fatalf("trail of 5 after 8 events: %d events from %q, oldest %d", len(page.Events), page.Events[0].Owner, page.Oldest)
	}
	last := page.Through
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l, err = Open(path, Options{MaxEvents: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	woken := l.EventsAfter(last)
	select {
	case <-woken:
		t.Fatal("EventsAfter the last event was closed before a new one")
	default:
	}
	reserve(t, l, "job-8", "GPU-8")
	select {
	case <-woken:
	case <-time.After(10 * time.Second):
		t.Fatal("EventsAfter not closed by a new event")
	}
	if got := allEvents(t, l, device.EventFilter{After: last}); len(got) != 1 || got[0].Seq != last+1 || got[0].Owner != "job-8" {
		t.Errorf("events after %d on the reopened ledger: %+v, want job-8's at %d", last, got, last+1)
	}
	if got := allEvents(t, l, device.EventFilter{}); len(got) != 5 {
		t.Errorf("%d events after the reopen, want 5", len(got))
	}
}

// Events older than MaxEventAge go as new ones are written.
func TestEventsDroppedWithAge(t *testing.T) {
	clock, advance := settableClock()
	l, err := Open(statePath(t), Options{MaxEventAge: time.Hour, Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	reserve(t, l, "old-1", "GPU-1")
	reserve(t, l, "old-2", "GPU-2")
	advance(2 * time.Hour)
	reserve(t, l, "new", "GPU-3")
	if got := allEvents(t, l, device.EventFilter{}); len(got) != 1 || got[0].Owner != "new" {
		t.Errorf("events after two hours: %v, want the new one alone", got)
	}
}

// A flood of refused calls cannot push the changes out of the trail: a bounded number
// a second is recorded, and the next recorded says how many were not.
func TestRefusalFloodIsBounded(t *testing.T) {
	clock, advance := settableClock()
	l, err := Open(statePath(t), Options{Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx := context.Background()
	reserve(t, l, "holder", "GPU-0")
	for range 200 {
		if _, _, err := l.Reserve(ctx, res("other", "GPU-0"), nil, nil); err == nil {
			t.Fatal("a Reserve of a held device succeeded")
		}
	}
	reserve(t, l, "after", "GPU-1") // the deferred refusals ride on this commit
	var refused int
	for _, e := range allEvents(t, l, device.EventFilter{}) {
		if e.Kind == device.EventRefused {
			refused++
		}
	}
	if refused != refusedPerSecond {
		t.Errorf("%d refusals recorded of 200 in one second, want %d", refused, refusedPerSecond)
	}
	advance(time.Second) // a new second: the next refusal is recorded, with the count
	if _, _, err := l.Reserve(ctx, res("other", "GPU-0"), nil, nil); err == nil {
		t.Fatal("a Reserve of a held device succeeded")
	}
	reserve(t, l, "after-2", "GPU-2")
	events := allEvents(t, l, device.EventFilter{})
	var note string
	for _, e := range events {
		if e.Kind == device.EventRefused && strings.Contains(e.Detail, "not recorded") {
			note = e.Detail
		}
	}
	if !strings.Contains(note, "refusals before it not recorded") {
		t.Errorf("no refusal says how many were not recorded: %v", events[len(events)-3:])
	}
}

// The file may hold a sixteenth more events than the bound, dropped in one go, so that
// most commits write only the trail's newest page; readers are shown the newest
// MaxEvents all the same, before and after a reopen.
func TestEventsPastTheBoundDroppedInChunksShownNever(t *testing.T) {
	path := statePath(t)
	l, err := Open(path, Options{MaxEvents: 32})
	if err != nil {
		t.Fatal(err)
	}
	inFile := func(l *Ledger) int {
		n := 0
		if err := l.read(func(tx *bolt.Tx) error { n = tx.Bucket(bucketEvents).Stats().KeyN; return nil }); err != nil {
			t.Fatal(err)
		}
		return n
	}
	most := 0
	for i := range 60 {
		reserve(t, l, fmt.Sprintf("job-%d", i), fmt.Sprintf("GPU-%d", i))
		most = max(most, inFile(l))
	}
	if most != 34 {
		t.Errorf("the file held at most %d events, want 32 and a sixteenth (34)", most)
	}
	check := func(l *Ledger) {
		t.Helper()
		got := allEvents(t, l, device.EventFilter{})
		if len(got) != 32 || got[0].Owner != "job-28" || got[31].Owner != "job-59" {
			t.Fatalf("shown %d events, from %q, want the newest 32, job-28 to job-59", len(got), got[0].Owner)
		}
		if page, err := l.Events(context.Background(), device.EventFilter{Limit: 1}); err != nil || page.Oldest != got[0].Seq {
			t.Errorf("Oldest = %d (%v), want %d", page.Oldest, err, got[0].Seq)
		}
	}
	check(l)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l, err = Open(path, Options{MaxEvents: 32})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	check(l)
}

// A commit whose fsync failed may leave its pages where a read finds them: events past
// the last position the ledger gave out are not shown, and the next event takes the
// position and reads as itself.
func TestEventsPastTheLastCommittedAreNotShown(t *testing.T) {
	l := openWithEvents(t, Options{})
	reserve(t, l, "job-0", "GPU-0")
	// What a failed commit leaves visible: an event record at the next position.
	stray := device.Event{Kind: device.EventReserve, Owner: "never-acknowledged"}
	if err := l.db.Update(func(tx *bolt.Tx) error {
		payload, err := json.Marshal(eventRecord{Time: time.Now().UTC(), Kind: string(stray.Kind), Owner: stray.Owner})
		if err != nil {
			return err
		}
		return tx.Bucket(bucketEvents).Put(seqKey(2), seal(payload))
	}); err != nil {
		t.Fatal(err)
	}
	if got := allEvents(t, l, device.EventFilter{}); len(got) != 1 || got[0].Owner != "job-0" {
		t.Fatalf("events = %v, want job-0's alone: the stray record was never committed by the ledger", got)
	}
	reserve(t, l, "job-1", "GPU-1")
	got := allEvents(t, l, device.EventFilter{})
	if len(got) != 2 || got[1].Seq != 2 || got[1].Owner != "job-1" {
		t.Errorf("events = %v, want job-1's at position 2", got)
	}
}
