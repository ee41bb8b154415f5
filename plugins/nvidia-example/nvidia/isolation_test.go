package nvidia

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

func reserveWith(t *testing.T, p *Plugin, options map[string]string, ids ...string) *pb.ContainerReservation {
	t.Helper()
	res, err := p.ReserveOptions(context.Background(), ids, options)
	if err != nil {
		t.Fatalf("Reserve(%v, %v): %v", ids, options, err)
	}
	return res
}

// refusal is a Reserve with options the plugin must refuse, and the message it must give.
type refusal struct {
	name    string
	ids     []string
	options map[string]string
	want    string
}

// expectRefusals makes each Reserve of tests and checks it is INVALID_ARGUMENT with its
// message, and that no MPS daemon runs after them.
func expectRefusals(t *testing.T, p *Plugin, tests []refusal) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := p.ReserveOptions(context.Background(), tt.ids, tt.options)
			if status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != tt.want {
				t.Errorf("Reserve(%v, %v) = %v\nwant INVALID_ARGUMENT: %s", tt.ids, tt.options, err, tt.want)
			}
		})
	}
	if n := p.mps.active(); n != 0 {
		t.Errorf("%d daemons after refused Reserves, want none", n)
	}
}

// A Reserve's option mps_isolation chooses its daemon: on one GPU a shared holder and
// a per-holder holder get two daemons, in two pipe directories; the shared daemon
// stopping leaves the per-holder one and its directory alone. A restarted plugin told
// each live reservation's options adopts both daemons, as they were.
func TestMPSIsolationChosenPerReserve(t *testing.T) {
	cfg := restartableMPSConfig(t, "") // the default: shared
	first := newMPSPlugin(t, cfg)
	gpu0 := simulatedUUID("dgxh100", 0)
	shared := reserveWith(t, first, map[string]string{"mps_isolation": "shared"}, mpsShareID(gpu0, 0))
	byDefault := reserveWith(t, first, nil, mpsShareID(gpu0, 3))
	own := reserveWith(t, first, map[string]string{"mps_isolation": "per-holder"}, mpsShareID(gpu0, 1), mpsShareID(gpu0, 2))
	recS, dirS := daemonWith(t, first, MPSShared, gpu0)
	recH, dirH := daemonWith(t, first, MPSPerHolder, gpu0, mpsShareID(gpu0, 1))
	pipeS, pipeH := shared.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"], own.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]
	t.Logf("shared holder's pipe dir %s (daemon %d), per-holder holder's %s (daemon %d)", pipeS, recS.PID, pipeH, recH.PID)
	if pipeS != filepath.Join(dirS, "pipe") || pipeH != filepath.Join(dirH, "pipe") || pipeS == pipeH || recS.PID == recH.PID {
		t.Fatalf("pipe dirs %q (daemon %d) and %q (daemon %d); want the device's shared daemon and the holder's own", pipeS, recS.PID, pipeH, recH.PID)
	}
	if got := byDefault.GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]; got != pipeS {
		t.Errorf("a Reserve without the option got pipe dir %q; want the config's default, the shared daemon's %q", got, pipeS)
	}
	if recH.Limits == nil || recH.Limits.Threads != 50 || recS.Limits != nil {
		t.Errorf("daemon limits: per-holder %+v, shared %+v; want 50%% set on the per-holder one, none on the shared one", recH.Limits, recS.Limits)
	}
	if got := ask(t, first, dirH, "get_default_active_thread_percentage"); got != "50.0" {
		t.Errorf("the per-holder daemon's default thread percentage = %q, want 50.0", got)
	}

	// The plugin process ends (the host restarts it): its daemons run on, and the next
	// one is told the live reservations with their options.
	first.mps.close()
	first.mps = nil
	second := newMPSPlugin(t, cfg)
	live := []deviceplugin.LiveReservation{
		{ID: "r-shared", DeviceIDs: []string{mpsShareID(gpu0, 0)}, Options: map[string]string{"mps_isolation": "shared"}},
		{ID: "r-default", DeviceIDs: []string{mpsShareID(gpu0, 3)}},
		{ID: "r-own", DeviceIDs: []string{mpsShareID(gpu0, 1), mpsShareID(gpu0, 2)}, Options: map[string]string{"mps_isolation": "per-holder"}},
	}
	if err := second.Reconcile(context.Background(), live); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	againS, _ := daemonWith(t, second, MPSShared, gpu0)
	againH, againDirH := daemonWith(t, second, MPSPerHolder, gpu0, mpsShareID(gpu0, 1))
	if againS.PID != recS.PID || againH.PID != recH.PID || againDirH != dirH || !processAlive(recH.PID, recH.Start) || !processAlive(recS.PID, recS.Start) {
		t.Errorf("after the restart: shared daemon %d, per-holder daemon %d in %s; want %d and %d in %s, adopted", againS.PID, againH.PID, againDirH, recS.PID, recH.PID, dirH)
	}
	if n := second.mps.active(); n != 2 {
		t.Errorf("%d daemons after Reconcile, want 2", n)
	}

	// The shared daemon's last holders go: it stops, and the per-holder daemon under
	// its directory runs on, its pipe directory kept.
	release(t, second, mpsShareID(gpu0, 0))
	release(t, second, mpsShareID(gpu0, 3))
	if processAlive(recS.PID, recS.Start) || !processAlive(recH.PID, recH.Start) {
		t.Errorf("after the shared holders' Release: shared daemon alive %v (want false), per-holder %v (want true)",
			processAlive(recS.PID, recS.Start), processAlive(recH.PID, recH.Start))
	}
	if _, err := os.Stat(filepath.Join(pipeH, "control")); err != nil {
		t.Errorf("the per-holder daemon's control pipe after the shared daemon stopped: %v", err)
	}
	if _, err := os.Stat(pipeS); !os.IsNotExist(err) {
		t.Errorf("the stopped shared daemon's pipe dir %s: %v, want it gone", pipeS, err)
	}
	release(t, second, mpsShareID(gpu0, 1), mpsShareID(gpu0, 2))
	if _, err := os.Stat(dirS); !os.IsNotExist(err) {
		t.Errorf("the device's MPS directory %s after every Release: %v, want it gone", dirS, err)
	}
}

// What a Reserve's options ask that the plugin cannot honour is refused,
// INVALID_ARGUMENT naming the option, and nothing is started.
func TestMPSIsolationOptionRefusals(t *testing.T) {
	cfg := mpsConfig(mpsDir(t), MPSPerHolder)
	cfg.MPSIsolationAllowed = []string{MPSPerHolder}
	p := newMPSPlugin(t, cfg)
	gpu0 := simulatedUUID("dgxh100", 0)
	tests := []refusal{
		{"an option on a whole GPU", []string{gpu0}, map[string]string{"mps_isolation": "per-holder"},
			"reserve: option mps_isolation applies to MPS shares only; " + gpu0 + " is a whole GPU"},
		{"a forbidden isolation", []string{mpsShareID(gpu0, 0)}, map[string]string{"mps_isolation": "shared"},
			`reserve: option mps_isolation = "shared" is not allowed by the plugin's config (mps_isolation_allowed = ["per-holder"])`},
		{"an unknown value", []string{mpsShareID(gpu0, 0)}, map[string]string{"mps_isolation": "strict"},
			`reserve: option mps_isolation = "strict": want "shared" or "per-holder"`},
		{"an unknown option", []string{mpsShareID(gpu0, 0)}, map[string]string{"mps_isolation": "per-holder", "mps_priority": "high"},
			`option "mps_priority" is unknown to plugin "nvidia-example", which takes mps_isolation, mps_thread_percentage, mps_memory_limit`},
	}
	expectRefusals(t, p, tests)
	// The allowed one is served.
	if got := reserveWith(t, p, map[string]string{"mps_isolation": "per-holder"}, mpsShareID(gpu0, 0)).GetEnvs()["CUDA_MPS_PIPE_DIRECTORY"]; !strings.Contains(got, "/holder-0/") {
		t.Errorf("a per-holder Reserve's pipe dir %q, want the holder's own", got)
	}
}

func TestMPSIsolationAllowedConfig(t *testing.T) {
	mps := func(isolation string, allowed ...string) Config {
		return Config{Replicas: 2, Sharing: SharingModes{"mps"}, MPSIsolation: isolation, MPSIsolationAllowed: allowed}
	}
	tests := []struct {
		name string
		cfg  Config
		want string // "" for accepted
	}{
		{"both", mps("", "shared", "per-holder"), ""},
		{"only per-holder, the default", mps("per-holder", "per-holder"), ""},
		{"only per-holder, default left shared", mps("", "per-holder"),
			`config: mps_isolation_allowed = ["per-holder"] leaves out mps_isolation = "shared", the isolation of a Reserve that asks for none; set mps_isolation to one it allows`},
		{"unknown", mps("", "shared", "strict"), `config: mps_isolation_allowed = ["shared", "strict"]: "strict" is not an isolation; want "shared", "per-holder" or both`},
		{"twice", mps("", "shared", "shared"), `config: mps_isolation_allowed = ["shared", "shared"]: "shared" is listed twice`},
		{"without mps", Config{Replicas: 2, MPSIsolationAllowed: []string{"shared"}}, `config: mps_isolation_allowed: only valid with sharing = "mps"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig(mustJSON(t, tt.cfg))
			if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
				t.Errorf("parseConfig = %v\nwant %q", err, tt.want)
			}
		})
	}
	_, err := parseConfig([]byte(`{"replicas": 2, "sharing": "mps", "mps_isolation_allowed": []}`))
	if want := "config: mps_isolation_allowed = []: allows no isolation; leave it out for both"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("parseConfig of an empty list = %v\nwant %q", err, want)
	}
}
