package manager

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager/inventory"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/testwait"
)

// These tests check that a plugin cannot take another plugin's devices: an
// ID is bound to the plugin that reported it first, across restarts of that plugin and
// of the host, and a reservation is only ever routed to the plugin recorded in it.

var gpusKey = device.GroupKey{Vendor: "fixture", Type: "widget", Name: "gpus"}

// servedBy reports whether every listed device is in plugin's inventory.
func servedBy(plugin string, ids ...string) func(device.Snapshot) bool {
	return func(s device.Snapshot) bool {
		have := deviceIDs(s.Inventory)
		for _, id := range ids {
			if !slices.Contains(have, plugin+"/"+id) {
				return false
			}
		}
		return true
	}
}

// TestProcessDeviceBindingsSurviveRestarts runs the original plugin of two devices
// alone, then starts a host on the same state dir where an impostor reports those IDs
// before the original does (and again every 100ms): the IDs are refused to the
// impostor, stay bound to the original, and Reserve is answered by the original, also
// after the original is SIGKILLed and restarts while the impostor keeps reporting them.
func TestProcessDeviceBindingsSurviveRestarts(t *testing.T) {
	cfg, logs := durableConfig(t)
	orig := fixture{name: "original", cfg: fixtureplugin.Config{Groups: widgets("gpus", "GPU-a", "GPU-b"), ReserveTag: "original"}}
	first := startManager(t, cfg, orig)
	waitSnapshot(t, first, "the original's devices", servedBy("original", "GPU-a", "GPU-b"))
	shutdown(t, first)

	impostor := fixture{name: "impostor", cfg: fixtureplugin.Config{
		Groups:                 widgets("gpus", "GPU-a", "GPU-b", "i0"),
		ReserveTag:             "impostor",
		FingerprintChangeEvery: fixtureplugin.Duration(100 * time.Millisecond),
	}}
	orig.cfg.FingerprintDelay = fixtureplugin.Duration(2 * time.Second) // the impostor reports first
	m := startManager(t, cfg, impostor, orig)
	waitSnapshot(t, m, "the impostor's own device", servedBy("impostor", "i0"))
	logs.waitLine(t, "[ERROR]", "device IDs bound to another plugin refused", "plugin=impostor", "bound_to=original", `devices="GPU-a, GPU-b"`)
	if got := pluginOf(m.Snapshot(), "impostor").LastError; !strings.Contains(got, `GPU-a, GPU-b bound to plugin "original"`) {
		t.Errorf("impostor LastError = %q, want it to name the refused IDs and the plugin they are bound to", got)
	}
	snap := waitSnapshot(t, m, "the original's devices", healthIs(device.HealthHealthy, "GPU-a", "GPU-b"))
	if got, want := deviceIDs(snap.Inventory), []string{"impostor/i0", "original/GPU-a", "original/GPU-b"}; !slices.Equal(got, want) {
		t.Errorf("inventory = %v, want %v", got, want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-1", Group: gpusKey, DeviceIDs: []string{"GPU-a"}})
	if err != nil || r.Plugin != "original" || r.Container.Envs["FIXTURE_TAG"] != "original" {
		t.Fatalf("Reserve GPU-a = %+v, %v; want it answered by the original", r, err)
	}

	// The original dies; while it restarts (2s before its first fingerprint) the
	// impostor reports its IDs every 100ms. They stay bound to the original, and nobody
	// answers for them.
	watch := m.Watch(ctx)
	if err := syscall.Kill(pid(t, m, "original"), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitWithin(t, watch, testwait.Timeout, "the original down", healthIs(device.HealthUnhealthy, "GPU-a", "GPU-b"))
	_, err = m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-2", Group: gpusKey, DeviceIDs: []string{"GPU-b"}})
	if !errors.Is(err, device.ErrPluginUnavailable) && !errors.Is(err, device.ErrUnhealthyDevice) {
		t.Errorf("Reserve GPU-b while its plugin restarts = %v, want it refused as unavailable or unhealthy", err)
	}
	snap = waitWithin(t, watch, testwait.Timeout, "the original back", healthIs(device.HealthHealthy, "GPU-a", "GPU-b"))
	if got, want := deviceIDs(snap.Inventory), []string{"impostor/i0", "original/GPU-a", "original/GPU-b"}; !slices.Equal(got, want) {
		t.Errorf("inventory after the original's restart = %v, want %v", got, want)
	}
	r, err = m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-2", Group: gpusKey, DeviceIDs: []string{"GPU-b"}})
	if err != nil || r.Plugin != "original" || r.Container.Envs["FIXTURE_TAG"] != "original" {
		t.Errorf("Reserve GPU-b after the original's restart = %+v, %v; want it answered by the original", r, err)
	}
}

// TestDeviceBindingsInBothStartOrders checks, with in-process plugins whose order the
// test controls, that who reports first on a later start does not matter.
func TestDeviceBindingsInBothStartOrders(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()

	t.Run("impostor reports first after a host restart", func(t *testing.T) {
		cfg, logs := durableConfig(t)
		first, _ := startInprocManager(t, cfg, newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1")))
		waitSnapshot(t, first, "alpha's devices", servedBy("alpha", "a0", "a1"))
		crash(t, first)

		alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
		alpha.hangFP = true // reports only when the test says
		beta := newFakeDevices("beta", group("acme", "gpu", "A1", "a0", "b0"))
		m, _ := startInprocManager(t, cfg, alpha, beta)
		snap := waitSnapshot(t, m, "beta's own device", servedBy("beta", "b0"))
		if got, want := deviceIDs(snap.Inventory), []string{"beta/b0"}; !slices.Equal(got, want) {
			t.Errorf("inventory before alpha reports = %v, want %v", got, want)
		}
		logs.waitLine(t, "[ERROR]", "device IDs bound to another plugin refused", "plugin=beta", "bound_to=alpha", "devices=a0")

		// a0 and a1 are bound to alpha (the ledger says so) though alpha has not reported them
		// since the host started: a caller retrying after the restart is told to retry,
		// not that they do not exist. b0 is bound to beta only.
		_, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-1", Group: acmeA1, DeviceIDs: []string{"a0", "a1"}})
		if !errors.Is(err, device.ErrPluginUnavailable) || !strings.Contains(err.Error(), `belong to plugin "alpha", which has not reported its devices since the host started`) {
			t.Errorf("Reserve a0, a1 before alpha reports = %v, want ErrPluginUnavailable naming alpha", err)
		}
		if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-1", Group: acmeA1, DeviceIDs: []string{"a0", "zz"}}); !errors.Is(err, device.ErrUnknownDevice) {
			t.Errorf("Reserve a0 and an ID bound to no plugin = %v, want ErrUnknownDevice", err)
		}
		if alpha.reserveCalls() != 0 || beta.reserveCalls() != 0 {
			t.Errorf("plugins asked to reserve: alpha %d, beta %d; want none", alpha.reserveCalls(), beta.reserveCalls())
		}

		alpha.set(func(f *fakeDevices) { f.hangFP = false })
		alpha.setGroups(group("acme", "gpu", "A1", "a0", "a1"))
		waitSnapshot(t, m, "alpha's devices", servedBy("alpha", "a0", "a1"))
		if r := reserve(t, m, "job-1", "a0"); r.Plugin != "alpha" || alpha.reserveCalls() != 1 || beta.reserveCalls() != 0 {
			t.Errorf("Reserve a0 = plugin %q with %d calls to alpha, %d to beta; want alpha's", r.Plugin, alpha.reserveCalls(), beta.reserveCalls())
		}
	})

	t.Run("bound plugin reports first; relaunched, it reports the ID only later", func(t *testing.T) {
		cfg, logs := testConfig(t) // in memory: bindings hold for the host's life
		alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "a0", "a1"))
		beta := newFakeDevices("beta", group("acme", "gpu", "A1", "b0"))
		m, l := startInprocManager(t, cfg, alpha, beta)
		waitSnapshot(t, m, "both plugins", servedBy("alpha", "a0", "a1"))
		waitSnapshot(t, m, "both plugins", servedBy("beta", "b0"))

		// alpha dies and comes back without a0 (its driver has not found it yet);
		// meanwhile beta reports a0.
		alpha.setGroups(group("acme", "gpu", "A1", "a1"))
		p, _ := l.latest("alpha")
		p.exit("signal: killed")
		beta.setGroups(group("acme", "gpu", "A1", "a0", "b0"))
		logs.waitLine(t, "[ERROR]", "device IDs bound to another plugin refused", "plugin=beta", "bound_to=alpha", "devices=a0")
		waitSnapshot(t, m, "alpha relaunched", func(s device.Snapshot) bool {
			return pluginOf(s, "alpha").Restarts == 1 && healthIs(device.HealthHealthy, "a1")(s)
		})
		if got, want := deviceIDs(m.Inventory()), []string{"alpha/a1", "beta/b0"}; !slices.Equal(got, want) {
			t.Errorf("inventory = %v, want %v: a0 stays bound to alpha while it does not report it", got, want)
		}
		_, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job-1", Group: acmeA1, DeviceIDs: []string{"a0"}})
		if !errors.Is(err, device.ErrUnknownDevice) || beta.reserveCalls() != 0 {
			t.Errorf("Reserve a0 while alpha does not report it = %v with %d calls to beta; want ErrUnknownDevice, none", err, beta.reserveCalls())
		}

		alpha.setGroups(group("acme", "gpu", "A1", "a0", "a1"))
		waitSnapshot(t, m, "a0 back with alpha", servedBy("alpha", "a0"))
		if r := reserve(t, m, "job-1", "a0"); r.Plugin != "alpha" || beta.reserveCalls() != 0 {
			t.Errorf("Reserve a0 = plugin %q, %d calls to beta; want alpha's", r.Plugin, beta.reserveCalls())
		}
	})

	t.Run("bound plugin no longer configured", func(t *testing.T) {
		cfg, logs := durableConfig(t)
		first, _ := startInprocManager(t, cfg, newFakeDevices("old", group("acme", "gpu", "A1", "a0")))
		waitSnapshot(t, first, "old's device", servedBy("old", "a0"))
		shutdown(t, first)

		m, _ := startInprocManager(t, cfg, newFakeDevices("new", group("acme", "gpu", "A1", "a0")))
		waitSnapshot(t, m, "a0 taken over by new", servedBy("new", "a0"))
		logs.waitLine(t, "[INFO]", "bound to a plugin this host does not run", "previous_plugin=old", "devices=1")
		logs.waitLine(t, "[WARN]", "are now bound to this plugin", "plugin=new", "previous_plugin=old", "devices=a0")
	})
}

// TestPluginInventingIDsIsBoundToABoundedNumber: a plugin that reports thousands of new
// IDs in every fingerprint does not grow the binding records without end: past
// inventory.MaxBoundPerPlugin it loses the IDs it no longer reports, in memory and in the ledger.
func TestPluginInventingIDsIsBoundToABoundedNumber(t *testing.T) {
	cfg, logs := durableConfig(t)
	// 4000 IDs of round r, in 4 groups of 1000 (a group holds at most 1024).
	groups := func(r int) []*pb.DeviceGroup {
		var out []*pb.DeviceGroup
		for g := range 4 {
			var ids []string
			for i := range 1000 {
				ids = append(ids, fmt.Sprintf("r%d-%d%03d", r, g, i))
			}
			out = append(out, group("acme", "gpu", fmt.Sprint("A", g), ids...))
		}
		return out
	}
	churn := newFakeDevices("churn", groups(0)...)
	m, _ := startInprocManager(t, cfg, churn)
	for round := range 4 {
		if round > 0 {
			churn.setGroups(groups(round)...)
		}
		want := fmt.Sprintf("r%d-0000", round)
		waitSnapshot(t, m, "round "+want, servedBy("churn", want))
	}
	logs.waitLine(t, "[WARN]", "more distinct device IDs than may be bound to one plugin", "plugin=churn", "forgotten=8000")
	bound := m.reg.Bound("churn")
	recorded, err := m.ledger.DeviceBindings()
	if err != nil {
		t.Fatal(err)
	}
	if bound > inventory.MaxBoundPerPlugin || len(recorded) > inventory.MaxBoundPerPlugin {
		t.Errorf("after 4 rounds of 4000 new IDs %d are bound to the plugin, %d recorded; want at most %d", bound, len(recorded), inventory.MaxBoundPerPlugin)
	}
	if recorded["r3-0000"] != "churn" || recorded["r0-0000"] != "" {
		t.Errorf("recorded bindings of r3-0000, r0-0000 = %q, %q; want churn, none", recorded["r3-0000"], recorded["r0-0000"])
	}
}

// A plugin pinned to device ID patterns cannot take another plugin's IDs, whichever
// fingerprints first: the impostor's copies of the real plugin's GPU IDs are refused,
// named in its last error, and every Reserve of them goes to the real plugin.
func TestDeviceIDPatternsPinPlugins(t *testing.T) {
	real := newFakeDevices("real", group("nvidia", "gpu", "H100", "GPU-0", "GPU-1"))
	impostor := newFakeDevices("impostor", group("nvidia", "gpu", "H100", "GPU-0", "GPU-1"), group("acme", "fpga", "F", "FPGA-0"))
	cfg, _ := testConfig(t)
	cfg.Plugins = map[string]PluginConfig{
		"real":     {DeviceIDs: []string{"GPU-*"}},
		"impostor": {DeviceIDs: []string{"FPGA-*"}},
	}
	m, _ := startInprocManager(t, cfg, impostor, real)
	snap := waitSnapshot(t, m, "both plugins' own devices", func(s device.Snapshot) bool {
		ids := deviceIDs(s.Inventory)
		return slices.Contains(ids, "real/GPU-0") && slices.Contains(ids, "impostor/FPGA-0") &&
			strings.Contains(pluginOf(s, "impostor").LastError, "outside the plugin's device_ids patterns")
	})
	if ids := deviceIDs(snap.Inventory); !slices.Equal(ids, []string{"impostor/FPGA-0", "real/GPU-0", "real/GPU-1"}) {
		t.Errorf("inventory %v, want the impostor's FPGA and the real plugin's GPUs alone", ids)
	}
	if e := pluginOf(snap, "impostor").LastError; !strings.Contains(e, "GPU-0, GPU-1") {
		t.Errorf("impostor's last error %q, want it to name GPU-0, GPU-1", e)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	r, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job", Group: device.GroupKey{Vendor: "nvidia", Type: "gpu", Name: "H100"}, DeviceIDs: []string{"GPU-0"}})
	if err != nil || r.Plugin != "real" {
		t.Fatalf("Reserve of GPU-0: %+v, %v; want it through plugin real", r, err)
	}
	if n := impostor.reserveCalls(); n != 0 {
		t.Errorf("the impostor was asked %d times", n)
	}
}

// Two plugins that report the same IDs before the host is ready, neither pinned by
// device_ids, get neither of them: which one started first says nothing about whose
// they are. Both plugins' last errors say how to decide; the IDs they do not share
// are theirs. A plugin pinned to the IDs gets them whichever reported first.
func TestIDsContestedAtStartBoundToNeither(t *testing.T) {
	t.Run("neither pinned", func(t *testing.T) {
		alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "x0", "a0"))
		beta := newFakeDevices("beta", group("acme", "gpu", "A1", "x0", "b0"))
		cfg, logs := testConfig(t)
		m, _ := startInprocManager(t, cfg, alpha, beta)
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
		defer cancel()
		waitReady(t, m)
		// The plugin that reported x0 second gets its error from its own fingerprint's
		// outcome, published just after the snapshot that unbinds x0: wait for both.
		named := func(e string) bool {
			return strings.Contains(e, "x0 were reported by two plugins before the host was ready and are bound to neither") && strings.Contains(e, "device_ids")
		}
		waitSnapshot(t, m, "each plugin's own device, and both plugins' errors naming x0", func(s device.Snapshot) bool {
			return slices.Equal(deviceIDs(s.Inventory), []string{"alpha/a0", "beta/b0"}) &&
				named(pluginOf(s, "alpha").LastError) && named(pluginOf(s, "beta").LastError)
		})
		logs.waitLine(t, "[ERROR]", "bound to neither", "devices=x0")
		if _, err := m.Reserve(ctx, device.ReserveRequest{OwnerID: "job", Group: acmeA1, DeviceIDs: []string{"x0"}}); !errors.Is(err, device.ErrUnknownDevice) {
			t.Errorf("Reserve of the contested x0: %v, want ErrUnknownDevice", err)
		}
	})
	t.Run("one pinned", func(t *testing.T) {
		alpha := newFakeDevices("alpha", group("acme", "gpu", "A1", "x0", "a0"))
		beta := newFakeDevices("beta", group("acme", "gpu", "A1", "x0", "b0"))
		cfg, _ := testConfig(t)
		cfg.Plugins = map[string]PluginConfig{"beta": {DeviceIDs: []string{"x*", "b*"}}}
		m, _ := startInprocManager(t, cfg, alpha, beta)
		waitSnapshot(t, m, "x0 with the pinned plugin", func(s device.Snapshot) bool {
			return slices.Equal(deviceIDs(s.Inventory), []string{"alpha/a0", "beta/b0", "beta/x0"})
		})
	})
}
