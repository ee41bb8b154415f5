package nvidia

import (
	"context"
	"syscall"
	"testing"

	"github.com/devicehost/devicehost/deviceplugin"
)

// A shared holder's options lower the limits in its environment; a holder beside it
// on the same GPU that asks nothing keeps what its share gives.
func TestMPSLimitsLoweredShared(t *testing.T) {
	p := newMPSPlugin(t, mpsConfig(mpsDir(t), MPSShared))
	gpu0 := simulatedUUID("dgxh100", 0)
	lowered := reserveWith(t, p, map[string]string{"mps_thread_percentage": "10", "mps_memory_limit": "8192"}, mpsShareID(gpu0, 0), mpsShareID(gpu0, 1))
	plain := reserveWith(t, p, nil, mpsShareID(gpu0, 2))
	tests := []struct {
		holder               string
		envs                 map[string]string
		wantThreads, wantMem string
	}{
		{"the holder of 2 shares that lowered its limits", lowered.GetEnvs(), "10", "0=8192M"},
		{"the holder of 1 share that asked nothing", plain.GetEnvs(), "25", "0=20480M"},
	}
	for _, tt := range tests {
		threads, mem := tt.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], tt.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
		t.Logf("%s: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%s", tt.holder, threads, mem)
		if threads != tt.wantThreads || mem != tt.wantMem {
			t.Errorf("%s: threads %q, memory %q; want %q and %q", tt.holder, threads, mem, tt.wantThreads, tt.wantMem)
		}
	}
	if a, b := lowered.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"], plain.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]; a != b {
		t.Errorf("pipe dirs %q and %q; want the device's one shared daemon", a, b)
	}
}

// A per-holder holder's lowered limits are its own daemon's default limits, and stay
// so across a plugin restart: Reconcile, told the reservations' options, adopts the
// daemon that serves them (a daemon with other limits would be replaced) and rebuilds
// one that died while the plugin was down with them.
func TestMPSLimitsLoweredPerHolderAcrossRestart(t *testing.T) {
	cfg := restartableMPSConfig(t, MPSPerHolder)
	first := newMPSPlugin(t, cfg)
	gpu0, gpu1 := simulatedUUID("dgxh100", 0), simulatedUUID("dgxh100", 1)
	options := map[string]string{"mps_thread_percentage": "30", "mps_memory_limit": "10240"}
	held := []string{mpsShareID(gpu0, 0), mpsShareID(gpu0, 1)}
	died := []string{mpsShareID(gpu1, 2), mpsShareID(gpu1, 3)}
	res := reserveWith(t, first, options, held...)
	reserveWith(t, first, options, died...)
	if got := res.GetEnvs()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] + " " + res.GetEnvs()["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]; got != "30 0=10240M" {
		t.Errorf("the holder's env limits %q, want \"30 0=10240M\"", got)
	}
	want := mpsLimits{Threads: 30, MemMiB: 10240}
	checkDaemon := func(when string, p *Plugin, device string, shares []string) mpsRecord {
		t.Helper()
		rec, dir := daemonWith(t, p, MPSPerHolder, device, shares...)
		threads := ask(t, p, dir, "get_default_active_thread_percentage")
		mem := ask(t, p, dir, "get_default_device_pinned_mem_limit 0")
		t.Logf("%s: daemon %d of %v: default thread percentage %s, pinned memory limit %s", when, rec.PID, shares, threads, mem)
		if rec.Limits == nil || *rec.Limits != want || threads != "30.0" || mem != "10240M" {
			t.Errorf("%s: daemon of %v records %+v and answers %s%%, %s; want %+v, 30.0%% and 10240M (its shares give 50%% and 40960M)",
				when, shares, rec.Limits, threads, mem, want)
		}
		return rec
	}
	kept := checkDaemon("after Reserve", first, gpu0, held)
	gone := checkDaemon("after Reserve", first, gpu1, died)

	// The plugin process ends; one daemon dies while it is down.
	first.mps.close()
	first.mps = nil
	if err := syscall.Kill(gone.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if !waitGone(gone.PID, gone.Start, mpsQuitTimeout) {
		t.Fatalf("daemon %d still runs after SIGKILL", gone.PID)
	}
	second := newMPSPlugin(t, cfg)
	live := []deviceplugin.LiveReservation{
		{ID: "r-held", DeviceIDs: held, Options: options},
		{ID: "r-died", DeviceIDs: died, Options: options},
	}
	if err := second.Reconcile(context.Background(), live); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	if again := checkDaemon("after the restart", second, gpu0, held); again.PID != kept.PID {
		t.Errorf("the live daemon is %d after the restart, want %d adopted", again.PID, kept.PID)
	}
	if again := checkDaemon("after the restart", second, gpu1, died); again.PID == gone.PID || !processAlive(again.PID, again.Start) {
		t.Errorf("the daemon that died is %d after the restart, want a new one running", again.PID)
	}
}

// Limits a Reserve cannot have are refused, INVALID_ARGUMENT naming the option and,
// above the shares' limits, both numbers; nothing is started.
func TestMPSLimitsRefusals(t *testing.T) {
	p := newMPSPlugin(t, mpsConfig(mpsDir(t), ""))
	gpu0 := simulatedUUID("dgxh100", 0)
	one := []string{mpsShareID(gpu0, 0)}
	tests := []refusal{
		{"threads above one share's", one, map[string]string{"mps_thread_percentage": "30"},
			"reserve: option mps_thread_percentage = 30 is above 25, what the holder's 1 MPS share of " + gpu0 + " gives; a holder may lower its limits, not raise them"},
		{"memory above one share's", one, map[string]string{"mps_memory_limit": "20481"},
			"reserve: option mps_memory_limit = 20481 (MiB) is above 20480, what the holder's 1 MPS share of " + gpu0 + " gives; a holder may lower its limits, not raise them"},
		{"both above", one, map[string]string{"mps_thread_percentage": "26", "mps_memory_limit": "40960"},
			"reserve: option mps_thread_percentage = 26 is above 25, what the holder's 1 MPS share of " + gpu0 + " gives; a holder may lower its limits, not raise them; " +
				"option mps_memory_limit = 40960 (MiB) is above 20480, what the holder's 1 MPS share of " + gpu0 + " gives; a holder may lower its limits, not raise them"},
		{"threads zero", one, map[string]string{"mps_thread_percentage": "0"},
			`reserve: option mps_thread_percentage = "0": want an integer percentage from 1 to 100`},
		{"threads above 100", one, map[string]string{"mps_thread_percentage": "101"},
			`reserve: option mps_thread_percentage = "101": want an integer percentage from 1 to 100`},
		{"threads not a number", one, map[string]string{"mps_thread_percentage": "10%"},
			`reserve: option mps_thread_percentage = "10%": want an integer percentage from 1 to 100`},
		{"memory with a unit", one, map[string]string{"mps_memory_limit": "8Gi"},
			`reserve: option mps_memory_limit = "8Gi": want an integer number of MiB, at least 1`},
		{"memory above two shares'", []string{mpsShareID(gpu0, 1), mpsShareID(gpu0, 2)}, map[string]string{"mps_memory_limit": "40961"},
			"reserve: option mps_memory_limit = 40961 (MiB) is above 40960, what the holder's 2 MPS shares of " + gpu0 + " give; a holder may lower its limits, not raise them"},
		{"memory zero", one, map[string]string{"mps_memory_limit": "0"},
			`reserve: option mps_memory_limit = "0": want an integer number of MiB, at least 1`},
		{"threads on a whole GPU", []string{gpu0}, map[string]string{"mps_thread_percentage": "10"},
			"reserve: option mps_thread_percentage applies to MPS shares only; " + gpu0 + " is a whole GPU"},
		{"memory on a whole GPU", []string{gpu0}, map[string]string{"mps_memory_limit": "1024"},
			"reserve: option mps_memory_limit applies to MPS shares only; " + gpu0 + " is a whole GPU"},
	}
	expectRefusals(t, p, tests)
	// At the shares' limits exactly is no raise.
	two := []string{mpsShareID(gpu0, 1), mpsShareID(gpu0, 2)}
	if got := reserveWith(t, p, map[string]string{"mps_thread_percentage": "50", "mps_memory_limit": "40960"}, two...).GetEnvs()["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; got != "50" {
		t.Errorf("a Reserve of 2 shares at their limits got threads %q, want 50", got)
	}
}
