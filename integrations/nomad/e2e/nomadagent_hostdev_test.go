package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/integrations/nomad/shim"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/tools/testwait"
)

// hostdevAgentConfig serves the host's /dev/fuse as 8 devices of hostdev/fuse beside
// `agent -dev`'s simulated GPUs.
const hostdevAgentConfig = `plugin "hostdev" {
  config {
    device "fuse" {
      paths = ["/dev/fuse"]
      count = 8
    }
  }
}
`

// openFuse is shell that prints FUSE_OK when /dev/fuse opens read-write, else
// FUSE_OPEN_FAILED and the shell's error (a subshell: a failed redirection of exec
// would end the script).
const openFuse = `if err=$( (exec 3<>/dev/fuse) 2>&1 ); then echo FUSE_OK; else echo "FUSE_OPEN_FAILED $err"; fi`

// probePath is where fuseprobe (testdata/fuseprobe) is in an exec task's chroot,
// beside /etc/passwd and /etc/group only.
const probePath = "/fuseprobe"

// hostdevTasks are the tasks of the job TestNomadAgentHostDev runs: driver, command
// and args (each prints a line starting with FUSE_, then waits to be stopped) and
// whether it asks for `device "hostdev/fuse" { count = 1 }`.
var hostdevTasks = []struct {
	name, driver, command string
	args                  []string
	device                bool
}{
	{"exec-fuse", "exec", probePath, nil, true},
	{"exec-nodev", "exec", probePath, nil, false},
	{"raw-fuse", "raw_exec", "/bin/sh", []string{"-c", "env | sort; " + openFuse + "; exec sleep 3600"}, true},
}

// A real Nomad v1.6.3 agent runs one allocation of three tasks, two of them asking for
// the host's /dev/fuse, served by the hostdev plugin as hostdev/fuse: an exec task
// (Nomad's chroot, whose /dev holds only the nodes a task is given) finds the
// character device 10:229 at /dev/fuse that the shim's reservation names, while an
// exec task without the device finds none; a raw_exec task opens /dev/fuse
// read-write and sees its allocation in its environment. Each reservation is named after its task while the job runs and
// released once the job is stopped. The exec tasks run fuseprobe, a static program,
// in a chroot of three files (Nomad's default chroot takes many seconds to build).
//
// Nomad v1.6.3's exec driver makes the node but leaves it out of the task's device
// cgroup (hashicorp/nomad#22518, fixed in later releases), so the exec task cannot
// open it: the test logs what the open did there and requires it only of raw_exec
// (run with no_cgroups: on cgroup v2 its cgroup would refuse the open as well).
func TestNomadAgentHostDev(t *testing.T) {
	if fi, err := os.Stat("/dev/fuse"); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		t.Skipf("/dev/fuse is not a character device here (%v)", err)
	}
	nomadBin := nomadBinary(t)
	const grace = 2 * time.Second
	bins := build(t)
	tmp := tempDir(t, "dhnhd")
	cfgPath := filepath.Join(tmp, "agent.hcl")
	writeFile(t, cfgPath, hostdevAgentConfig)
	address := "unix://" + filepath.Join(tmp, "dh.sock")
	startAgent(t, bins[agentName], tmp, "agent", "-dev", "-listen", address, "-config", cfgPath, "-log-json")
	c := dial(t, address)

	ports := freePorts(t, 3)
	nomadAddr := "127.0.0.1:" + ports[0]
	probe := filepath.Join(tmp, "fuseprobe")
	buildStatic(t, "./testdata/fuseprobe", probe)
	cfg := writeNomadConfig(t, tmp, ports, bins[shim.BinaryName], address, nomadAddr, grace,
		nomadOptions{
			// Exec tasks run as nobody, whom libcontainer looks up in the chroot.
			chrootEnv:        map[string]string{probe: probePath, "/etc/passwd": "/etc/passwd", "/etc/group": "/etc/group"},
			rawExecNoCgroups: true,
		})
	nomad := startAgent(t, nomadBin, tmp, "agent", "-config", cfg, "-log-level", "debug")
	n := &nomadHTTP{t: t, addr: "http://" + nomadAddr}
	defer n.stopAll()
	nodeID := n.waitNodeWithGPUs(8)
	testwait.WaitFor(t, "8 healthy hostdev/fuse/fuse devices in Nomad's node status", func() bool {
		devs, err := n.nodeDevices(nodeID)
		healthy := 0
		for _, d := range devs["hostdev/fuse/fuse"] {
			if d.Healthy {
				healthy++
			}
		}
		return err == nil && healthy == 8
	})

	const job = "fuse"
	submitted := time.Now()
	n.submitHostDevJob(nomadBin, tmp, job)
	allocID := n.waitAlloc(job)
	out := map[string]string{}
	for _, task := range hostdevTasks {
		out[task.name] = n.waitTaskVerdict(nomadBin, allocID, task.name, nomad.Stdout)
	}
	verdicts := time.Since(submitted)
	var started []string
	testwait.WaitFor(t, "every task started in Nomad's allocation", func() bool {
		started = started[:0]
		a := n.alloc(allocID)
		for _, task := range hostdevTasks {
			at := a.TaskStates[task.name].StartedAt
			if at.IsZero() {
				return false
			}
			started = append(started, fmt.Sprintf("%s %v", task.name, at.Sub(submitted).Round(time.Millisecond)))
		}
		return true
	})
	t.Logf("job submitted to every task's verdict: %v (tasks started after: %s)",
		verdicts.Round(time.Millisecond), strings.Join(started, ", "))

	if !strings.HasPrefix(verdict(out["exec-fuse"]), "FUSE_NODE 10:229 ") {
		t.Errorf("exec task with the device: %q; want FUSE_NODE 10:229 (the character device /dev/fuse in its chroot)", verdict(out["exec-fuse"]))
	}
	if !strings.HasPrefix(verdict(out["exec-nodev"]), "FUSE_NO_NODE ") {
		t.Errorf("exec task without the device: %q; want FUSE_NO_NODE", verdict(out["exec-nodev"]))
	}
	if verdict(out["raw-fuse"]) != "FUSE_OK" {
		t.Errorf("raw_exec task with the device: %q; want FUSE_OK", verdict(out["raw-fuse"]))
	}
	if want := "NOMAD_ALLOC_ID=" + allocID + "\n"; !strings.Contains(out["raw-fuse"], want) {
		t.Errorf("raw_exec task's environment lacks %q:\n%s", want, out["raw-fuse"])
	}
	t.Logf("exec, device: %q; exec, no device: %q; raw_exec, device: %q (its env: %s)",
		verdict(out["exec-fuse"]), verdict(out["exec-nodev"]), verdict(out["raw-fuse"]), nomadEnv(out["raw-fuse"]))

	var held []*pb.Reservation
	for _, task := range hostdevTasks {
		if !task.device {
			continue
		}
		owner := shim.AllocOwner("default", job, allocID, task.name)
		r := waitActiveReservation(t, c, owner)
		var nodes []string
		for _, d := range r.GetReservation().GetDevices() {
			nodes = append(nodes, d.GetHostPath()+":"+d.GetContainerPath()+":"+d.GetPermissions())
		}
		if r.GetVendor() != "hostdev" || r.GetType() != "fuse" || len(r.GetDeviceIds()) != 1 ||
			len(nodes) != 1 || nodes[0] != "/dev/fuse:/dev/fuse:rw" {
			t.Errorf("reservation of %s: %s/%s %v, nodes %v; want one hostdev/fuse device, /dev/fuse:/dev/fuse:rw",
				owner, r.GetVendor(), r.GetType(), r.GetDeviceIds(), nodes)
		}
		t.Logf("%s holds %s (%v, nodes %v)", owner, r.GetReservationId(), r.GetDeviceIds(), nodes)
		held = append(held, r)
	}
	if st := n.alloc(allocID); st.ClientStatus != "running" {
		t.Errorf("allocation %s is %s once its reservations are named; want running", allocID, st.ClientStatus)
	}

	stopped := time.Now()
	n.deleteJob(job)
	var freed time.Time
	for _, r := range held {
		testwait.WaitFor(t, "the release of "+r.GetReservationId(), func() bool {
			rs, err := c.Reservations(context.Background(), &pb.ListReservationsRequest{OwnerId: r.GetOwnerId()})
			if err == nil && len(rs) == 1 && rs[0].GetState() == pb.ReservationState_RESERVATION_STATE_RELEASED {
				if at := rs[0].GetReleasedAt().AsTime(); at.After(freed) {
					freed = at
				}
				return true
			}
			return false
		})
	}
	n.waitStatus(allocID, "complete")
	var ended time.Time
	for _, ts := range n.alloc(allocID).TaskStates {
		if ts.FinishedAt.After(ended) {
			ended = ts.FinishedAt
		}
	}
	t.Logf("nomad job stop: stop to both devices free %v, last task end to free %v (release_grace %v)",
		freed.Sub(stopped).Round(time.Millisecond), freed.Sub(ended).Round(time.Millisecond), grace)
}

// verdict is the line of a task's output that starts with FUSE_.
func verdict(out string) string {
	for l := range strings.Lines(out) {
		if strings.HasPrefix(l, "FUSE_") {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

// nomadEnv is the NOMAD_ALLOC_ID and NOMAD_TASK_NAME lines of an `env` output.
func nomadEnv(out string) string {
	var kept []string
	for l := range strings.Lines(out) {
		if strings.HasPrefix(l, "NOMAD_ALLOC_ID=") || strings.HasPrefix(l, "NOMAD_TASK_NAME=") {
			kept = append(kept, strings.TrimSpace(l))
		}
	}
	return strings.Join(kept, " ")
}

// waitTaskVerdict waits until the stdout of the allocation's task (`nomad alloc logs`
// with the nomad binary bin) has a line starting with FUSE_, and returns that stdout.
// A task that ends before fails the test with its stdout, stderr and events.
func (n *nomadHTTP) waitTaskVerdict(bin, allocID, task string, log fmt.Stringer) string {
	t := n.t
	t.Helper()
	logs := func(flags ...string) string {
		cmd := exec.Command(bin, append(append([]string{"alloc", "logs"}, flags...), allocID, task)...)
		cmd.Env = append(os.Environ(), "NOMAD_ADDR="+n.addr)
		out, _ := cmd.CombinedOutput()
		return string(out)
	}
	var out string
	testwait.WaitFor(t, "a FUSE_ line in the stdout of task "+task+", or its end", func() bool {
		out = logs()
		return verdict(out) != "" || n.alloc(allocID).TaskStates[task].State == "dead"
	})
	if verdict(out) == "" {
		t.Fatalf("task %s ended without a verdict: stdout %q, stderr %q, events %s\nnomad output:\n%s",
			task, out, logs("-stderr"), n.taskEvents(allocID, task), lastLines(log.String(), 80))
	}
	return out
}

// taskEvents returns the events of the allocation's task, one "type: message" a line.
func (n *nomadHTTP) taskEvents(allocID, task string) string {
	var a struct {
		TaskStates map[string]struct {
			Events []struct{ Type, DisplayMessage string }
		}
	}
	if err := n.get("/v1/allocation/"+allocID, &a); err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range a.TaskStates[task].Events {
		fmt.Fprintf(&b, "\n  %s: %s", e.Type, e.DisplayMessage)
	}
	return b.String()
}

// buildStatic builds the main package pkg (relative to this package) without cgo, a
// program that needs nothing beside it, to out.
func buildStatic(t *testing.T, pkg, out string) {
	t.Helper()
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
}

// submitHostDevJob submits (detached) a batch job called name, written to
// dir/<name>.hcl: one group of hostdevTasks, never restarted or rescheduled.
func (n *nomadHTTP) submitHostDevJob(bin, dir, name string) {
	t := n.t
	t.Helper()
	var tasks strings.Builder
	for _, task := range hostdevTasks {
		device := ""
		if task.device {
			device = `
        device "hostdev/fuse" {
          count = 1
        }`
		}
		args, err := json.Marshal(task.args)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&tasks, `
    task %q {
      driver       = %q
      kill_timeout = "1s"
      config {
        command = %q
        args    = %s
      }
      resources {
        cpu    = 100
        memory = 32%s
      }
    }`, task.name, task.driver, task.command, args, device)
	}
	path := filepath.Join(dir, name+".hcl")
	writeFile(t, path, fmt.Sprintf(`
job %q {
  type        = "batch"
  datacenters = ["dc1"]
  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }
    reschedule {
      attempts  = 0
      unlimited = false
    }%s
  }
}
`, name, tasks.String()))
	n.runJobFile(bin, path, name)
}
