package dra

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	drahealthpb "k8s.io/kubelet/pkg/apis/dra-health/v1"
	registerpb "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// The driver makes its plugin directory where nothing did (a fresh node: the kubelet
// has its plugins_registry, nobody has made plugins/<driver>), as its defaults promise,
// before anything listens in it: the health socket too, at its default place there.
func TestRunMakesPluginDir(t *testing.T) {
	r := newRig(t)
	r.pluginDir = filepath.Join(r.dir, "fresh", "plugins", testDriver)
	sock := filepath.Join(r.pluginDir, HealthSocketName)
	r.startDriver(withHealth(sock, time.Minute, time.Minute)) // waits until the DRA socket in it answers
	fi, err := os.Stat(r.pluginDir)
	if err != nil || !fi.IsDir() {
		t.Fatalf("plugin dir %s: %v", r.pluginDir, err)
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("health socket %s: %v", sock, err)
	}
}

// The driver registers with the kubelet and publishes the agent's 8 simulated H100s
// as one pool, each device with the agent's facts in DRA's types.
func TestPublishesAgentDevices(t *testing.T) {
	r := newRig(t)
	r.startDriver(nil)
	k := r.kubelet()

	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	info, err := k.reg.GetInfo(ctx, &registerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetType() != registerpb.DRAPlugin || info.GetName() != testDriver || info.GetEndpoint() != filepath.Join(r.pluginDir, "dra.sock") ||
		!slices.Contains(info.GetSupportedVersions(), "v1.DRAPlugin") {
		t.Errorf("GetInfo = %v; want a DRAPlugin named %s at %s serving v1.DRAPlugin", info, testDriver, filepath.Join(r.pluginDir, "dra.sock"))
	}

	snap, err := r.c.Devices(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids, group := gpus(snap)
	if len(ids) != 8 {
		t.Fatalf("agent -dev reports %d GPUs, want 8", len(ids))
	}
	devs := r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	mem := group.GetAttributes()["memory"].GetIntValue()
	for i, id := range ids {
		d := devs[i]
		agentDev := findDevice(snap, id)
		if d.Name != DeviceName(id) {
			t.Errorf("device %d: name %q, want %q", i, d.Name, DeviceName(id))
		}
		for k, want := range map[resourceapi.QualifiedName]string{
			"id": id, "uuid": id, "vendor": "nvidia", "type": "gpu", "productName": group.GetName(),
			"resource.kubernetes.io/pciBusID": strings.ToLower(agentDev.GetLocality().GetPciBusId()),
		} {
			if got := d.Attributes[k].StringValue; got == nil || *got != want {
				t.Errorf("device %s: attribute %s = %v, want %q", id, k, got, want)
			}
		}
		if v, ok := version(group.GetAttributes()["driver_version"].GetStringValue()); ok {
			if got := d.Attributes["driverVersion"].VersionValue; got == nil || *got != v {
				t.Errorf("device %s: driverVersion = %v, want %s", id, got, v)
			}
		} else {
			t.Errorf("agent's driver_version %q is no version", group.GetAttributes()["driver_version"].GetStringValue())
		}
		if got := d.Capacity["memory"].Value; got.Value() != mem<<20 {
			t.Errorf("device %s: memory capacity %s, want %d MiB", id, got.String(), mem)
		}
		if n := agentDev.GetLocality().GetNumaNode(); n >= 0 {
			if got := d.Attributes["resource.kubernetes.io/numaNode"].IntValue; got == nil || *got != int64(n) {
				t.Errorf("device %s: numaNode %v, want %d", id, got, n)
			}
		}
		if len(d.Taints) != 0 || len(d.ConsumesCounters) != 0 {
			t.Errorf("device %s: taints %v, counters %v; want none", id, d.Taints, d.ConsumesCounters)
		}
	}
}

// prepared reads the agent's live reservations of claim c.
func (r *rig) prepared(c *resourceapi.ResourceClaim) []*pb.Reservation {
	r.t.Helper()
	rs, err := r.c.Reservations(context.Background(), &pb.ListReservationsRequest{
		OwnerId: claimRef{c.Namespace, c.Name, string(c.UID)}.owner(), State: pb.ReservationState_RESERVATION_STATE_ACTIVE})
	if err != nil {
		r.t.Fatal(err)
	}
	return rs
}

// resolves reports whether every CDI ID resolves through the specs in the CDI dir.
func (r *rig) resolves(ids ...string) bool {
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(r.cdiDir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		r.t.Fatal(err)
	}
	for _, id := range ids {
		if strings.HasPrefix(id, testDriver+"/") && cache.GetDevice(id) == nil {
			return false
		}
	}
	return true
}

// Prepare of 2 GPUs is one Reserve owned by the claim; asking again gets the same
// answer; unprepare releases it, and again is no error.
func TestPrepareUnprepare(t *testing.T) {
	r := newRig(t)
	rd := r.startDriver(nil)
	k := r.kubelet()
	ids, _ := r.waitGPUs()
	c := r.claim("pair", DeviceName(ids[2]), DeviceName(ids[5]))

	first := k.prepare(t, c)
	if first.GetError() != "" {
		t.Fatalf("prepare: %s", first.GetError())
	}
	rs := r.prepared(c)
	if len(rs) != 1 || !slices.Equal(rs[0].GetDeviceIds(), []string{ids[2], ids[5]}) {
		t.Fatalf("reservations of the claim: %v; want one of %s, %s", rs, ids[2], ids[5])
	}
	if l := rs[0].GetOwnerLabels(); len(l) != 2 || l["pod"] != "pair-pod" || l["namespace"] != "default" {
		t.Errorf("the reservation's owner labels %v; want the pod the claim is reserved for, pair-pod in default", l)
	}
	claimCDI := testDriver + "/claim=" + string(c.UID) + "-" + rs[0].GetReservationId()
	if len(first.GetDevices()) != 2 {
		t.Fatalf("prepare: %d devices, want 2", len(first.GetDevices()))
	}
	// Each device's own CDI name first: the kubelet names a device in the pod's
	// status by its first CDI ID, one entry per ID.
	for i, d := range first.GetDevices() {
		id := []string{ids[2], ids[5]}[i]
		want := []string{"nvidia.com/gpu=" + id, claimCDI}
		if d.GetPoolName() != testNode || d.GetDeviceName() != DeviceName(id) || !slices.Equal(d.GetRequestNames(), []string{"gpus"}) ||
			!slices.Equal(d.GetCdiDeviceIds(), want) {
			t.Errorf("device %d: %v; want pool %s, device %s, request gpus, CDI %v", i, d, testNode, DeviceName(id), want)
		}
	}
	if !r.resolves(claimCDI) {
		t.Errorf("CDI ID %s does not resolve through %s", claimCDI, r.cdiDir)
	}

	again := k.prepare(t, c)
	if !proto.Equal(first, again) {
		t.Errorf("prepare again: %v; want the first answer %v", again, first)
	}
	if rs2 := r.prepared(c); len(rs2) != 1 || rs2[0].GetReservationId() != rs[0].GetReservationId() {
		t.Errorf("after prepare again: reservations %v; want still only %s", rs2, rs[0].GetReservationId())
	}

	if e := k.unprepare(t, c); e != "" {
		t.Fatalf("unprepare: %s", e)
	}
	if rs := r.prepared(c); len(rs) != 0 {
		t.Errorf("after unprepare: live reservations %v", rs)
	}
	if r.resolves(claimCDI) {
		t.Errorf("after unprepare: CDI ID %s still resolves", claimCDI)
	}
	if e := k.unprepare(t, c); e != "" {
		t.Errorf("unprepare again: %s", e)
	}

	// Once a claim was prepared, the next claim's CDI spec file is made ahead, off
	// the kubelet's wait: one temporary file in the CDI dir, which the driver removes
	// when it stops.
	tmps := func() []string {
		m, err := filepath.Glob(filepath.Join(r.cdiDir, "*.tmp"))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	for deadline := time.Now().Add(testwait.Timeout); len(tmps()) != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("temporary files in the CDI dir: %v, want the one made ahead", tmps())
		}
	}
	rd.stop(t)
	if got := tmps(); len(got) != 0 {
		t.Errorf("temporary files in the CDI dir after the driver stopped: %v", got)
	}
}

// A device held by another owner (the device-plugin bridge, say) is published with
// a taint naming it, and a claim for it is refused with a message naming the holder;
// once released the taint goes.
func TestPrepareOfHeldDeviceRefused(t *testing.T) {
	r := newRig(t)
	r.startDriver(nil)
	k := r.kubelet()
	ids, group := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	const holder = "k8s/default/legacy/main"
	res, err := r.c.Reserve(context.Background(), &pb.ReserveRequest{OwnerId: holder, Vendor: group.GetVendor(), Type: group.GetType(), Name: group.GetName(), DeviceIds: ids[:1]})
	if err != nil {
		t.Fatal(err)
	}
	r.waitSlices("held taint", func(d []resourceapi.Device) bool {
		tt, ok := taintOf(d, DeviceName(ids[0]), testDriver+"/held")
		return ok && tt.Value == "k8s.default.legacy.main" && tt.Effect == resourceapi.DeviceTaintEffectNoSchedule
	})

	c := r.claim("wants-held", DeviceName(ids[0]), DeviceName(ids[1]))
	got := k.prepare(t, c)
	if e := got.GetError(); !strings.Contains(e, holder) || !strings.Contains(e, res.GetReservationId()) || !strings.Contains(e, ids[0]) {
		t.Errorf("prepare: error %q; want one naming %s, %s and %s", e, ids[0], holder, res.GetReservationId())
	}
	if rs := r.prepared(c); len(rs) != 0 {
		t.Errorf("refused claim holds %v", rs)
	}

	if _, err := r.c.ReleaseReservation(context.Background(), res.GetReservationId()); err != nil {
		t.Fatal(err)
	}
	r.waitSlices("held taint gone", func(d []resourceapi.Device) bool {
		_, ok := taintOf(d, DeviceName(ids[0]), testDriver+"/held")
		return len(d) == 8 && !ok
	})
	if got := k.prepare(t, c); got.GetError() != "" {
		t.Errorf("prepare once free: %s", got.GetError())
	}
}

// A driver restarted between prepare and unprepare (its CDI specs lost, as a tmpfs
// /var/run/cdi at reboot) has the specs back before the kubelet asks, and unprepares
// from the ledger.
func TestDriverRestartBetweenPrepareAndUnprepare(t *testing.T) {
	r := newRig(t)
	first := r.startDriver(nil)
	ids, _ := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	c := r.claim("survivor", DeviceName(ids[0]), DeviceName(ids[1]))
	prep := r.kubelet().prepare(t, c)
	if prep.GetError() != "" {
		t.Fatalf("prepare: %s", prep.GetError())
	}
	claimCDI := prep.GetDevices()[0].GetCdiDeviceIds()[1]
	if !strings.HasPrefix(claimCDI, testDriver+"/claim=") {
		t.Fatalf("device 0's CDI IDs %v: the claim's is not second", prep.GetDevices()[0].GetCdiDeviceIds())
	}
	first.stop(t)
	if err := os.RemoveAll(r.cdiDir); err != nil {
		t.Fatal(err)
	}

	r.startDriver(nil)
	if !r.resolves(claimCDI) {
		t.Fatalf("after restart: CDI ID %s does not resolve: spec not repaired from the ledger", claimCDI)
	}
	k := r.kubelet()
	if again := k.prepare(t, c); !proto.Equal(again, prep) {
		t.Errorf("prepare after restart: %v; want %v", again, prep)
	}
	if e := k.unprepare(t, c); e != "" {
		t.Fatalf("unprepare after restart: %s", e)
	}
	if rs := r.prepared(c); len(rs) != 0 {
		t.Errorf("after unprepare: live reservations %v", rs)
	}
}

// healthWatch records the health reports of one NodeWatchResources stream.
type healthWatch struct {
	ch chan *drahealthpb.NodeWatchResourcesResponse
}

func (k *kubelet) watchHealth(t testing.TB) *healthWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := k.health.NodeWatchResources(ctx, &drahealthpb.NodeWatchResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	h := &healthWatch{ch: make(chan *drahealthpb.NodeWatchResourcesResponse, 1000)}
	go func() {
		defer close(h.ch)
		for {
			m, err := stream.Recv()
			if err != nil {
				return
			}
			h.ch <- m
		}
	}()
	return h
}

// wait waits for a report in which every device has health want (n devices).
func (h *healthWatch) wait(t testing.TB, n int, want drahealthpb.HealthStatus) {
	t.Helper()
	timeout := time.After(testwait.Timeout)
	for {
		select {
		case m, ok := <-h.ch:
			if !ok {
				t.Fatalf("health stream ended before every device was %s", want)
			}
			all := len(m.GetDevices()) == n
			for _, d := range m.GetDevices() {
				all = all && d.GetHealth() == want && d.GetDevice().GetPoolName() == testNode
			}
			if all {
				return
			}
		case <-timeout:
			t.Fatalf("no health report with all %d devices %s in %v", n, want, testwait.Timeout)
		}
	}
}

// The agent restarting between prepare and unprepare loses nothing: while it is
// gone the devices are tainted and their health unknown; then unprepare releases
// the claim at the restarted agent, and taints and health clear.
func TestAgentRestartBetweenPrepareAndUnprepare(t *testing.T) {
	r := newRig(t)
	r.startDriver(nil)
	k := r.kubelet()
	ids, _ := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	health := k.watchHealth(t)
	health.wait(t, 8, drahealthpb.HealthStatus_HEALTHY)
	c := r.claim("across-agent-restart", DeviceName(ids[3]), DeviceName(ids[4]))
	if p := k.prepare(t, c); p.GetError() != "" {
		t.Fatalf("prepare: %s", p.GetError())
	}

	r.agent.Kill()
	health.wait(t, 8, drahealthpb.HealthStatus_UNKNOWN)
	r.waitSlices("agent-unreachable taints", func(d []resourceapi.Device) bool {
		for _, dev := range d {
			if tt, ok := taintOf(d, dev.Name, testDriver+"/unhealthy"); !ok || tt.Value != "agent-unreachable" {
				return false
			}
		}
		return len(d) == 8
	})
	if e := k.unprepare(t, c); e == "" {
		t.Errorf("unprepare while the agent is down: no error; want one (the kubelet retries)")
	}

	r.startAgent()
	health.wait(t, 8, drahealthpb.HealthStatus_HEALTHY)
	if rs := r.prepared(c); len(rs) != 1 {
		t.Fatalf("after agent restart: claim's reservations %v; want its one", rs)
	}
	if e := k.unprepare(t, c); e != "" {
		t.Fatalf("unprepare after agent restart: %s", e)
	}
	if rs := r.prepared(c); len(rs) != 0 {
		t.Errorf("after unprepare: live reservations %v", rs)
	}
	r.waitSlices("taints clear", func(d []resourceapi.Device) bool {
		for _, dev := range d {
			if len(dev.Taints) > 0 {
				return false
			}
		}
		return len(d) == 8
	})
}

// A plugin SIGKILLed: its devices turn unhealthy at the agent, and the driver
// publishes the unhealthy taint and reports them unhealthy; both clear when the
// agent has restarted the plugin.
func TestPluginKilledTaintsAndHealth(t *testing.T) {
	r := newRig(t)
	r.startDriver(nil)
	k := r.kubelet()
	r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 })
	health := k.watchHealth(t)
	health.wait(t, 8, drahealthpb.HealthStatus_HEALTHY)
	// The publisher is running (its start waits for an informer).
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	pids := pluginPIDs(r.agent)
	if len(pids) == 0 {
		t.Fatal("the agent has no plugin process")
	}
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	health.wait(t, 8, drahealthpb.HealthStatus_UNHEALTHY)
	r.waitSlices("unhealthy taints", func(d []resourceapi.Device) bool {
		for _, dev := range d {
			if _, ok := taintOf(d, dev.Name, testDriver+"/unhealthy"); !ok {
				return false
			}
		}
		return len(d) == 8
	})
	health.wait(t, 8, drahealthpb.HealthStatus_HEALTHY)
	r.waitSlices("taints clear", func(d []resourceapi.Device) bool {
		for _, dev := range d {
			if len(dev.Taints) > 0 {
				return false
			}
		}
		return len(d) == 8
	})
}

// A claim deleted while the driver was down is released after the grace period, not
// before and never while the API server cannot be read; a claim that still exists
// keeps its devices.
func TestStaleClaimReleasedAfterGrace(t *testing.T) {
	r := newRig(t)
	first := r.startDriver(nil)
	ids, _ := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	k := r.kubelet()
	gone := r.claim("gone", DeviceName(ids[0]))
	kept := r.claim("kept", DeviceName(ids[1]))
	for _, c := range []*resourceapi.ResourceClaim{gone, kept} {
		if p := k.prepare(t, c); p.GetError() != "" {
			t.Fatalf("prepare %s: %s", c.Name, p.GetError())
		}
	}
	first.stop(t)
	if err := r.kube.ResourceV1().ResourceClaims("default").Delete(context.Background(), gone.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	var unreadable atomic.Bool
	unreadable.Store(true)
	r.kube.PrependReactor("get", "resourceclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
		if unreadable.Load() {
			return true, nil, apierrors.NewServiceUnavailable("etcd is down")
		}
		return false, nil, nil
	})
	type timedRound struct {
		staleRound
		at time.Time
	}
	rounds := make(chan timedRound, 10000)
	r.staleHook = func(sr staleRound) {
		select {
		case rounds <- timedRound{sr, time.Now()}:
		default:
		}
	}
	const grace = 200 * time.Millisecond
	r.startDriver(func(c *Config) { c.StaleGrace = grace; c.StaleInterval = 10 * time.Millisecond })

	timeout := time.After(testwait.Timeout)
	next := func() timedRound {
		t.Helper()
		select {
		case tr := <-rounds:
			return tr
		case <-timeout:
			t.Fatal("no stale round in time")
		}
		return timedRound{}
	}
	// Rounds over more than the grace with the API server unreadable release nothing.
	start := time.Now()
	for {
		tr := next()
		if tr.err == nil || len(tr.released) > 0 {
			t.Fatalf("round while the API server is unreadable: %+v", tr.staleRound)
		}
		if tr.at.Sub(start) > 2*grace {
			break
		}
	}
	if rs := r.prepared(gone); len(rs) != 1 {
		t.Fatalf("while the API server is unreadable: deleted claim's reservations %v; want kept", rs)
	}

	unreadable.Store(false)
	var firstMissing time.Time
	for {
		tr := next()
		if tr.err != nil {
			continue
		}
		if tr.missing != 1 || tr.claims != 2 {
			t.Fatalf("round: %+v; want 2 claims, 1 missing", tr.staleRound)
		}
		if firstMissing.IsZero() {
			firstMissing = tr.at
		}
		if len(tr.released) == 0 {
			continue
		}
		if want := []string{claimRef{gone.Namespace, gone.Name, string(gone.UID)}.owner()}; !slices.Equal(tr.released, want) {
			t.Fatalf("released %v; want %v", tr.released, want)
		}
		if d := tr.at.Sub(firstMissing); d < grace-20*time.Millisecond {
			t.Errorf("released %v after the claim was first seen missing; grace is %v", d, grace)
		}
		break
	}
	if rs := r.prepared(gone); len(rs) != 0 {
		t.Errorf("deleted claim still holds %v", rs)
	}
	if rs := r.prepared(kept); len(rs) != 1 {
		t.Errorf("existing claim's reservations %v; want its one", rs)
	}
	if _, err := os.Stat(filepath.Join(r.cdiDir, testDriver+"-claim-"+string(gone.UID)+".json")); !os.IsNotExist(err) {
		t.Errorf("deleted claim's CDI spec: %v; want removed", err)
	}
}

// The kubelet deletes every ResourceSlice of its node when it starts. The driver
// publishes its pool again within a second (the helper's controller by itself took
// 30 s): until then the scheduler would place no claim on the node. A second
// deletion, after the first republish, is mended as well.
func TestPoolRepublishedAfterDeletion(t *testing.T) {
	r := newRig(t)
	rd := r.startDriver(nil)
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	ctx := context.Background()
	for round := 1; round <= 2; round++ {
		list, err := r.kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		for _, s := range list.Items {
			if err := r.kube.ResourceV1().ResourceSlices().Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		r.waitSlicesWithin(10*time.Second, fmt.Sprintf("round %d: 8 GPUs again after the deletion", round),
			func(d []resourceapi.Device) bool { return len(d) == 8 })
		t.Logf("round %d: %d slices deleted, pool published again %v later", round, len(list.Items), time.Since(start).Round(time.Millisecond))
	}
	if !strings.Contains(rd.log.String(), "publishing them again") {
		t.Errorf("the driver's log does not say why it published again:\n%s", rd.log)
	}
}

// A temporary spec file a killed driver left in the CDI dir (one made ahead, say) is
// removed when the driver starts and matches the specs to the ledger; a recent one,
// which another writer may be using, is left.
func TestStaleTemporarySpecFilesRemovedAtStart(t *testing.T) {
	r := newRig(t)
	if err := os.MkdirAll(r.cdiDir, 0o755); err != nil {
		t.Fatal(err)
	}
	stale, fresh := filepath.Join(r.cdiDir, "spec.1234.tmp"), filepath.Join(r.cdiDir, "spec.5678.tmp")
	for _, p := range []string{stale, fresh} {
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-2 * staleTempAge)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	rd := r.startDriver(nil)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	if _, err := rd.log.Wait(ctx, func(l string) bool { return strings.Contains(l, "CDI specs match the ledger") }); err != nil {
		t.Fatalf("the driver did not match the CDI specs to the ledger: %v", err)
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale temporary file: %v, want removed", err)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Errorf("recent temporary file: %v, want left", err)
	}
}
