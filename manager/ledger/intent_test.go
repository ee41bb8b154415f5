package ledger

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/devicehost/devicehost/device"
)

// intent records an intent of owner for devs under id and fails the test otherwise.
func intend(t *testing.T, l *Ledger, id, owner string, devs ...string) device.Reservation {
	t.Helper()
	r := res(owner, devs...)
	r.ID = id
	got, existing, err := l.Intend(context.Background(), r, nil, nil)
	if err != nil || existing {
		t.Fatalf("Intend(%s, %s, %v) = existing %v, err %v; want a new intent", id, owner, devs, existing, err)
	}
	return got
}

// crashImage copies the state file at path as it is now (every write acknowledged so
// far is committed to it), as a stop at this moment would leave it, and returns the
// copy's path.
func crashImage(t *testing.T, path string) string {
	t.Helper()
	image := filepath.Join(t.TempDir(), DefaultFileName)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(image, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return image
}

// TestIntentHoldsItsDevicesAndShowsOnceAnswered: an intent holds its devices at once
// (another owner is refused, Holders names it) but is not a reservation a reader can
// use until its answer comes: Get and List skip it, its owner's retry is told it is
// unanswered; once answered it reads whole, and its record, with the answer, is in
// the file, durably (FinalizeNow).
func TestIntentHoldsItsDevicesAndShowsOnceAnswered(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	ctx := context.Background()
	in := intend(t, l, "res-a", "o1", "d0")
	if len(in.Container.Envs) != 0 || in.State != device.ReservationActive {
		t.Errorf("intent = %+v, want live and without a container", in)
	}

	if h := l.Holders()["d0"]; h.ReservationID != "res-a" || h.OwnerID != "o1" {
		t.Errorf("holder of d0 = %+v, want res-a of o1", h)
	}
	var held *device.HeldError
	if _, _, err := l.Reserve(ctx, res("o2", "d0"), nil, nil); !errors.As(err, &held) || held.Conflicts[0].Holder.ReservationID != "res-a" {
		t.Errorf("Reserve of d0 by o2 = %v, want a conflict with res-a", err)
	}
	if _, err := l.Get("res-a"); !errors.Is(err, device.ErrNotFound) {
		t.Errorf("Get of the unanswered intent = %v, want not found", err)
	}
	if rs := listAll(t, l); len(rs) != 0 {
		t.Errorf("List = %v, want the unanswered intent left out", ids(rs))
	}
	var ue *UnansweredError
	if _, err := l.Check("o1", []string{"d0"}, nil, nil, nil, nil); !errors.As(err, &ue) || ue.Reservation.ID != "res-a" {
		t.Errorf("Check by its owner = %v, want an UnansweredError for res-a", err)
	}

	answer := res("o1", "d0").Container
	if _, err := l.FinalizeNow(ctx, "res-a", answer, ""); err != nil {
		t.Fatal(err)
	}
	image := openWith(t, crashImage(t, path), Options{MaxEvents: -1})
	r, err := image.Get("res-a")
	if err != nil || r.State != device.ReservationActive || !reflect.DeepEqual(r.Container, answer) {
		t.Errorf("res-a in the file = %+v, %v; want live, with its answer", r, err)
	}
	if all := image.Intents(); len(all) != 0 {
		t.Errorf("intents in the file = %v, want none", ids(all))
	}
}

// TestIntentLeftByAStop: a stop between an intent and its answer's write leaves the
// devices held and the intent unanswered; answered later (FinalizeNow), it is a
// reservation like any, with its reserve event; withdrawn, its devices are free; it
// cannot be reowned meanwhile, and a Release ends it.
func TestIntentLeftByAStop(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	intend(t, l, "res-a", "o1", "d0")
	intend(t, l, "res-b", "o2", "d1")
	intend(t, l, "res-c", "o3", "d2")
	ctx := context.Background()

	image := openWith(t, crashImage(t, path), Options{})
	if got := ids(image.Intents()); !reflect.DeepEqual(got, []string{"res-a", "res-b", "res-c"}) {
		t.Fatalf("intents after the stop = %v, want res-a, res-b and res-c", got)
	}
	for _, d := range []string{"d0", "d1", "d2"} {
		if image.Holders()[d].ReservationID == "" {
			t.Errorf("%s not held after the stop", d)
		}
	}
	if _, err := image.Reown(ctx, device.ReownRequest{ReservationID: "res-a", OwnerID: "o1", NewOwnerID: "o9"}); err == nil ||
		!strings.Contains(err.Error(), "without its plugin's answer") {
		t.Errorf("Reown of an unanswered intent = %v, want refused as unanswered", err)
	}

	answer := res("o1", "d0").Container
	r, err := image.FinalizeNow(ctx, "res-a", answer, "asked again")
	if err != nil || r.ID != "res-a" || !reflect.DeepEqual(r.Container, answer) {
		t.Fatalf("FinalizeNow = %+v, %v; want res-a with its answer", r, err)
	}
	if _, err := image.FinalizeNow(ctx, "res-a", answer, "again"); !errors.Is(err, device.ErrNotFound) {
		t.Errorf("FinalizeNow of a reservation no longer an intent = %v, want not found", err)
	}
	if err := image.Withdraw(ctx, "res-b"); err != nil {
		t.Fatal(err)
	}
	if h, ok := image.Holders()["d1"]; ok {
		t.Errorf("d1 held by %+v after its intent was withdrawn", h)
	}
	if _, _, err := image.Reserve(ctx, res("o4", "d1"), nil, nil); err != nil {
		t.Errorf("Reserve of d1 after the withdrawal: %v", err)
	}
	if rel, _, err := image.Release(ctx, device.ReleaseRequest{OwnerID: "o3"}, t0); err != nil || len(rel) != 1 || rel[0].ID != "res-c" {
		t.Errorf("Release of o3 = %v, %v; want res-c released", ids(rel), err)
	}
	ev, err := image.Events(ctx, device.EventFilter{})
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, e := range ev.Events {
		kinds = append(kinds, string(e.Kind)+":"+strings.Join(e.Reservations, ",")+":"+e.Detail)
	}
	if !slices.Contains(kinds, "reserve:res-a:asked again") || slices.ContainsFunc(kinds, func(k string) bool { return strings.HasPrefix(k, "reserve:res-b:") }) {
		t.Errorf("events = %q, want res-a's reserve event, with its detail, and none for the withdrawn res-b", kinds)
	}
	if err := image.Close(); err != nil {
		t.Fatal(err)
	}

	again := openWith(t, image.Path(), Options{})
	if all := again.Intents(); len(all) != 0 {
		t.Errorf("intents after the answers = %v, want none", ids(all))
	}
	if r, err := again.Get("res-a"); err != nil || r.State != device.ReservationActive || !reflect.DeepEqual(r.Container, answer) {
		t.Errorf("res-a = %+v, %v; want live, with its answer", r, err)
	}
	if _, err := again.Get("res-b"); !errors.Is(err, device.ErrNotFound) {
		t.Errorf("Get of the withdrawn intent = %v, want not found", err)
	}
	if r, err := again.Get("res-c"); err != nil || r.State != device.ReservationReleased {
		t.Errorf("res-c = %+v, %v; want released", r, err)
	}
}

// TestIntendRefusesWhatReserveRefuses: Intend keeps the rules of Reserve, writes
// nothing when it refuses, leaves taking devices over to Reserve, and hands back its
// owner's reservation that already covers the request.
func TestIntendRefusesWhatReserveRefuses(t *testing.T) {
	l := openWith(t, statePath(t), Options{MaxEvents: -1})
	ctx := context.Background()
	held := reserve(t, l, "kube/pod-1", "d0")
	if _, err := l.Cordon(ctx, "d9", device.Cordon{Reason: "test", Since: t0}); err != nil {
		t.Fatal(err)
	}
	commits := l.Commits()
	try := func(id, owner string, takeOver []string, devs ...string) (device.Reservation, bool, error) {
		r := res(owner, devs...)
		r.ID = id
		return l.Intend(ctx, r, takeOver, nil)
	}
	if _, _, err := try("res-1", "o2", nil, "d0"); !errors.Is(err, device.ErrDeviceHeld) {
		t.Errorf("Intend of a held device = %v, want ErrDeviceHeld", err)
	}
	if _, _, err := try("res-1", "o2", []string{"kube/"}, "d0"); !errors.Is(err, ErrNeedsTakeOver) {
		t.Errorf("Intend taking a device over = %v, want ErrNeedsTakeOver", err)
	}
	if _, _, err := try("res-1", "o2", nil, "d9"); !errors.As(err, new(*device.CordonedError)) {
		t.Errorf("Intend of a cordoned device = %v, want a CordonedError", err)
	}
	if _, _, err := try(held.ID, "o2", nil, "d1"); !strings.Contains(fmtErr(err), "already used") {
		t.Errorf("Intend under a used ID = %v, want refused", err)
	}
	if _, _, err := try("", "o2", nil, "d1"); !strings.Contains(fmtErr(err), "no reservation ID") {
		t.Errorf("Intend without an ID = %v, want refused", err)
	}
	if got := l.Commits(); got != commits {
		t.Errorf("commits %d -> %d after refusals, want none", commits, got)
	}
	if r, existing, err := try("res-2", "kube/pod-1", nil, "d0"); err != nil || !existing || r.ID != held.ID || !reflect.DeepEqual(r.Container, held.Container) {
		t.Errorf("Intend by the holder for its devices = %+v, %v, %v; want %s back whole", r, existing, err, held.ID)
	}
}

func fmtErr(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestOpenRefusesAnIntentThatIsAlsoAReservation: a file whose intent and reservation
// records share an ID was not written by devicehost; Open names it.
func TestOpenRefusesAnIntentThatIsAlsoAReservation(t *testing.T) {
	path := statePath(t)
	l := openWith(t, path, Options{MaxEvents: -1})
	r := reserve(t, l, "o1", "d0")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketReservations).Get([]byte(r.ID))
		b, err := tx.CreateBucketIfNotExists(bucketIntents)
		if err != nil {
			return err
		}
		return b.Put([]byte(r.ID), v)
	})
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	_, err = Open(path, Options{})
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "intent") || !strings.Contains(err.Error(), r.ID) {
		t.Errorf("Open = %v, want ErrCorrupt naming intent %s", err, r.ID)
	}
}
