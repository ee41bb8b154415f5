package dra

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	drahealthpb "k8s.io/kubelet/pkg/apis/dra-health/v1"

	"github.com/devicehost/devicehost/client"
	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/device/devicetest"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/server/servertest"
	"github.com/devicehost/devicehost/tools/testwait"
)

// fakeDevices is a device.Manager whose snapshot the test sets; Watch delivers the
// latest to every watcher.
type fakeDevices struct {
	mu   sync.Mutex
	snap device.Snapshot
	subs map[chan device.Snapshot]bool
}

func offerSnap(ch chan device.Snapshot, s device.Snapshot) {
	select {
	case <-ch:
	default:
	}
	ch <- s
}

func (f *fakeDevices) set(edit func(*device.Snapshot)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	edit(&f.snap)
	f.snap.Seq++
	f.snap.Time = time.Now()
	for ch := range f.subs {
		offerSnap(ch, f.snap)
	}
}

func (f *fakeDevices) manager() *devicetest.Fake {
	ready := make(chan struct{})
	close(ready)
	return &devicetest.Fake{
		SnapshotFunc: func() device.Snapshot { f.mu.Lock(); defer f.mu.Unlock(); return f.snap },
		ReadyFunc:    func() <-chan struct{} { return ready },
		WatchFunc: func(ctx context.Context) <-chan device.Snapshot {
			ch := make(chan device.Snapshot, 1)
			f.mu.Lock()
			ch <- f.snap
			f.subs[ch] = true
			f.mu.Unlock()
			out := make(chan device.Snapshot)
			go func() {
				defer close(out)
				defer func() { f.mu.Lock(); delete(f.subs, ch); f.mu.Unlock() }()
				for {
					select {
					case s := <-ch:
						select {
						case out <- s:
						case <-ctx.Done():
							return
						}
					case <-ctx.Done():
						return
					}
				}
			}()
			return out
		},
	}
}

// partitioned is one GPU with two MIG partitions that share its slices.
func partitioned() device.Snapshot {
	set := device.CounterSetKey{Plugin: "nvidia", Name: "gpu-0"}
	devs := map[string]device.DeviceState{}
	for _, id := range []string{"GPU-0", "MIG-0-a", "MIG-0-b"} {
		devs[id] = device.DeviceState{Health: device.HealthHealthy}
	}
	return device.Snapshot{
		Inventory: device.Inventory{
			CounterSets: []device.CounterSet{{Key: set, Capacity: map[string]int64{"slices": 7}}},
			Groups: []device.Group{
				{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100"}, Plugin: "nvidia",
					Devices: []device.DeviceInfo{{ID: "GPU-0", Locality: device.Locality{NUMANode: -1},
						Consumes: []device.Consumption{{Set: set, Counters: map[string]int64{"slices": 7}}}}}},
				{GroupKey: device.GroupKey{Vendor: "nvidia", Type: "mig", Name: "3g.40gb"}, Plugin: "nvidia",
					Devices: []device.DeviceInfo{
						{ID: "MIG-0-a", Locality: device.Locality{NUMANode: -1}, Consumes: []device.Consumption{{Set: set, Counters: map[string]int64{"slices": 3}}}},
						{ID: "MIG-0-b", Locality: device.Locality{NUMANode: -1}, Consumes: []device.Consumption{{Set: set, Counters: map[string]int64{"slices": 3}}}},
					}},
			},
		},
		State: device.State{Devices: devs},
	}
}

// fakeRig is the driver on the real host API server over a fake manager.
type fakeRig struct {
	devs   *fakeDevices
	kube   *fake.Clientset
	driver *Driver
	health *healthWatch
}

func newFakeRig(t testing.TB) *fakeRig {
	t.Helper()
	f := &fakeDevices{snap: partitioned(), subs: make(map[chan device.Snapshot]bool)}
	sock := servertest.SocketPath(t)
	servertest.Serve(t, sock, server.Config{Manager: f.manager()})
	dir := servertest.ShortTempDir(t, "drafake")
	agent, err := client.Dial(context.Background(), "unix://"+sock, client.WithoutReachCheck(), client.WithBackoff(20*time.Millisecond, 200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Close() })
	kube := newKube()
	r := &rig{t: t, dir: dir, pluginDir: filepath.Join(dir, "plugins"), registryDir: filepath.Join(dir, "reg"), cdiDir: filepath.Join(dir, "cdi"), kube: kube}
	d, err := New(Config{Agent: agent, Kube: kube, ResourceREST: resourceREST(t, kube), NodeName: testNode, PluginDir: r.pluginDir, RegistryDir: r.registryDir, CDIDir: r.cdiDir,
		Logger: hclog.NewNullLogger()})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{r.pluginDir, r.registryDir} {
		if err := mkdir(p); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	r.waitSocket(filepath.Join(r.pluginDir, "dra.sock"))
	r.waitSocket(filepath.Join(r.registryDir, testDriver+"-reg.sock"))
	fr := &fakeRig{devs: f, kube: kube, driver: d}
	fr.health = r.kubelet().watchHealth(t)
	return fr
}

// waitPool waits for the pool's slices to satisfy ok.
func (fr *fakeRig) waitPool(t testing.TB, what string, ok func([]resourceapi.ResourceSlice) bool) []resourceapi.ResourceSlice {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	w, err := fr.kube.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	list, err := fr.kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	stored := make(map[string]resourceapi.ResourceSlice)
	for _, s := range list.Items {
		stored[s.Name] = s
	}
	for {
		items := slices.Collect(maps.Values(stored))
		sort.Slice(items, func(i, j int) bool { return items[i].Name < items[j].Name })
		if ok(items) {
			return items
		}
		select {
		case ev := <-w.ResultChan():
			if s, isSlice := ev.Object.(*resourceapi.ResourceSlice); isSlice {
				if ev.Type == watch.Deleted {
					delete(stored, s.Name)
				} else {
					stored[s.Name] = *s
				}
			}
		case <-ctx.Done():
			t.Fatalf("pool: %s: not seen; last %+v", what, items)
		}
	}
}

// The agent's counter sets reach the published pool: a slice of shared counters, and
// devices that consume them.
func TestSharedCountersPublished(t *testing.T) {
	fr := newFakeRig(t)
	pool := fr.waitPool(t, "counters and 3 devices", func(items []resourceapi.ResourceSlice) bool {
		n := 0
		for _, s := range items {
			n += len(s.Spec.Devices)
		}
		return len(items) == 2 && n == 3
	})
	var counters, devices *resourceapi.ResourceSlice
	for i := range pool {
		if len(pool[i].Spec.SharedCounters) > 0 {
			counters = &pool[i]
		} else {
			devices = &pool[i]
		}
	}
	if counters == nil || devices == nil || len(counters.Spec.Devices) != 0 {
		t.Fatalf("pool %+v; want a counters slice and a devices slice", pool)
	}
	for _, s := range pool {
		if s.Spec.Driver != testDriver || s.Spec.Pool.Name != testNode || s.Spec.NodeName == nil || *s.Spec.NodeName != testNode || s.Spec.Pool.ResourceSliceCount != 2 {
			t.Errorf("slice %s: driver %s, pool %+v, node %v; want %s, pool %s of 2 slices on node %s", s.Name, s.Spec.Driver, s.Spec.Pool, s.Spec.NodeName, testDriver, testNode, testNode)
		}
	}
	wantSet := []resourceapi.CounterSet{{Name: "nvidia-gpu-0", Counters: map[string]resourceapi.Counter{"slices": {Value: resource.MustParse("7")}}}}
	if !equalJSON(t, counters.Spec.SharedCounters, wantSet) {
		t.Errorf("shared counters %+v; want %+v", counters.Spec.SharedCounters, wantSet)
	}
	want := map[string]int64{DeviceName("GPU-0"): 7, DeviceName("MIG-0-a"): 3, DeviceName("MIG-0-b"): 3}
	for _, d := range devices.Spec.Devices {
		if len(d.ConsumesCounters) != 1 || d.ConsumesCounters[0].CounterSet != "nvidia-gpu-0" {
			t.Errorf("device %s consumes %+v; want nvidia-gpu-0", d.Name, d.ConsumesCounters)
			continue
		}
		got := d.ConsumesCounters[0].Counters["slices"].Value
		if got.Value() != want[d.Name] {
			t.Errorf("device %s consumes %s slices; want %d", d.Name, got.String(), want[d.Name])
		}
	}

	// A whole-GPU reservation of a non-DRA owner: the GPU is held, the partitions
	// blocked, all three tainted; released, the taints go.
	holder := &device.Holder{ReservationID: "res-1", OwnerID: "nomad/default/job/alloc/task"}
	fr.devs.set(func(s *device.Snapshot) {
		st := s.State.Devices["GPU-0"]
		st.Holder = holder
		s.State.Devices["GPU-0"] = st
		for _, id := range []string{"MIG-0-a", "MIG-0-b"} {
			st := s.State.Devices[id]
			st.BlockedBy = []device.Holder{*holder}
			s.State.Devices[id] = st
		}
	})
	tainted := func(items []resourceapi.ResourceSlice) int {
		n := 0
		for _, s := range items {
			for _, d := range s.Spec.Devices {
				if len(d.Taints) > 0 {
					n++
				}
			}
		}
		return n
	}
	fr.waitPool(t, "3 devices tainted", func(items []resourceapi.ResourceSlice) bool { return tainted(items) == 3 })
	fr.devs.set(func(s *device.Snapshot) { *s = partitioned() })
	fr.waitPool(t, "no taints", func(items []resourceapi.ResourceSlice) bool { return tainted(items) == 0 && len(items) == 2 })
}

// drain takes what ch holds now (messages of an earlier change).
func drain[T any](ch <-chan T) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

func mkdir(p string) error { return os.MkdirAll(p, 0o755) }

func equalJSON(t testing.TB, a, b any) bool {
	t.Helper()
	ja, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	jb, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return string(ja) == string(jb)
}

// BenchmarkHealthChange measures how long a device's health change at the agent takes
// to reach the published ResourceSlice taint (on the fake clientset) and the kubelet's WatchHealthStatus stream: p50 and p99 of each
// (target: 50 ms p99).
func BenchmarkHealthChange(b *testing.B) {
	fr := newFakeRig(b)
	fr.waitPool(b, "3 devices", func(items []resourceapi.ResourceSlice) bool {
		n := 0
		for _, s := range items {
			n += len(s.Spec.Devices)
		}
		return n == 3
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	w, err := fr.kube.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	gpu := DeviceName("GPU-0")
	var toTaint, toHealth []time.Duration
	for i := 0; b.Loop(); i++ {
		unhealthy := i%2 == 0
		drain(w.ResultChan())
		drain(fr.health.ch)
		start := time.Now()
		fr.devs.set(func(s *device.Snapshot) {
			st := s.State.Devices["GPU-0"]
			st.Health, st.Reason = device.HealthHealthy, ""
			if unhealthy {
				st.Health, st.Reason = device.HealthUnhealthy, "XID 79"
			}
			s.State.Devices["GPU-0"] = st
		})
		taintSeen, healthSeen := false, false
		for !taintSeen || !healthSeen {
			select {
			case ev := <-w.ResultChan():
				sl, ok := ev.Object.(*resourceapi.ResourceSlice)
				if !ok || taintSeen {
					continue
				}
				for _, d := range sl.Spec.Devices {
					if d.Name == gpu && (len(d.Taints) > 0) == unhealthy {
						taintSeen = true
						toTaint = append(toTaint, time.Since(start))
					}
				}
			case m := <-fr.health.ch:
				if healthSeen {
					continue
				}
				for _, d := range m.GetDevices() {
					if d.GetDevice().GetDeviceName() == gpu && (d.GetHealth() == drahealthpb.HealthStatus_UNHEALTHY) == unhealthy {
						healthSeen = true
						toHealth = append(toHealth, time.Since(start))
					}
				}
			case <-ctx.Done():
				b.Fatal("health change not seen")
			}
		}
	}
	pct := func(ds []time.Duration, p float64) float64 {
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[int(p*float64(len(s)-1))].Microseconds()) / 1000
	}
	b.ReportMetric(pct(toTaint, 0.5), "taint-p50-ms")
	b.ReportMetric(pct(toTaint, 0.99), "taint-p99-ms")
	b.ReportMetric(pct(toHealth, 0.5), "health-p50-ms")
	b.ReportMetric(pct(toHealth, 0.99), "health-p99-ms")
}
