package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/integrations/nomad/shim"
	"github.com/devicehost/devicehost/tools/testwait"
)

// mpsAgentConfig offers `agent -dev`'s simulated GPUs as 4 MPS shares each, one control
// daemon per GPU (the agent's binary, simulated), under the %q directory.
const mpsAgentConfig = `plugin "nvidia-example" {
  config {
    simulate = "dgxh100"
    replicas = 4
    sharing  = "mps"
    mps_dir  = %q
  }
}
`

// A real Nomad v1.6.3 agent runs a job on MPS shares: `device "nvidia/gpu.mps" { count =
// 2 }` gets two shares of one GPU (the shim offers each GPU's shares as a group of its
// own), the task's environment names that GPU, the daemon's pipe directory and two
// shares' limits, and once the job is stopped the daemon is gone.
func TestNomadAgentMPS(t *testing.T) {
	nomadBin := nomadBinary(t)
	bins := build(t)
	tmp := tempDir(t, "dhnmps")
	mpsDir := filepath.Join(tempDir(t, "mps"), "d")
	cfgPath := filepath.Join(tmp, "agent.hcl")
	writeFile(t, cfgPath, fmt.Sprintf(mpsAgentConfig, mpsDir))
	address := "unix://" + filepath.Join(tmp, "dh.sock")
	startAgent(t, bins[agentName], tmp, "agent", "-dev", "-listen", address, "-config", cfgPath, "-log-json")
	c := dial(t, address)

	ports := freePorts(t, 3)
	nomadAddr := "127.0.0.1:" + ports[0]
	cfg := writeNomadConfig(t, tmp, ports, bins[shim.BinaryName], address, nomadAddr, 2*time.Second, nomadOptions{})
	startAgent(t, nomadBin, tmp, "agent", "-config", cfg, "-log-level", "debug") // its output is logged if the test fails
	n := &nomadHTTP{t: t, addr: "http://" + nomadAddr}
	defer n.stopAll()
	nodeID := n.waitNodeWithGPUs(8)
	testwait.WaitFor(t, "8 MPS share groups of 4 in Nomad's node status", func() bool {
		devs, err := n.nodeDevices(nodeID)
		groups := 0
		for name, ds := range devs {
			if strings.HasPrefix(name, "nvidia/gpu.mps/") && len(ds) == 4 {
				groups++
			}
		}
		return err == nil && groups == 8
	})

	out := filepath.Join(tmp, "env")
	script := fmt.Sprintf(`printf '%%s %%s %%s\n' "$NVIDIA_VISIBLE_DEVICES" "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" > %[1]s.tmp && mv %[1]s.tmp %[1]s && exec sleep 3600`, out)
	allocID := n.runBatchJob(nomadBin, tmp, "mps", script, "nvidia/gpu.mps", 2)
	var fields []string
	testwait.WaitFor(t, "the task's environment", func() bool {
		b, err := os.ReadFile(out)
		fields = strings.Fields(string(b))
		return err == nil
	})
	if len(fields) != 3 || !strings.HasPrefix(fields[0], "GPU-") || !strings.HasPrefix(fields[1], mpsDir+"/") || fields[2] != "50" {
		t.Fatalf("the task saw NVIDIA_VISIBLE_DEVICES, CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = %q; want one GPU, a pipe under %s, 50", fields, mpsDir)
	}
	if _, err := os.Stat(filepath.Join(fields[1], "control")); err != nil {
		t.Errorf("the daemon's control pipe: %v", err)
	}
	owner := shim.AllocOwner("default", "mps", allocID, "train")
	r := waitActiveReservation(t, c, owner)
	for _, id := range r.GetDeviceIds() {
		if !strings.HasPrefix(id, fields[0]+"::mps::") {
			t.Errorf("the task's reservation holds %v; want two shares of %s", r.GetDeviceIds(), fields[0])
		}
	}
	t.Logf("task %s on %v: pipe %s", owner, r.GetDeviceIds(), fields[1])

	n.deleteJob("mps")
	testwait.WaitFor(t, "the daemon gone after the job stopped", func() bool {
		entries, err := os.ReadDir(mpsDir)
		return err == nil && len(entries) == 0
	})
}

// A real Nomad v1.6.3 agent with each GPU offered both time-sliced and in MPS shares
// (sharing = ["time-slicing", "mps"]): a job asking `device "nvidia/gpu.shared"` runs
// on a GPU, whose MPS shares and whole GPU then show unhealthy in Nomad's node status
// (the agent would refuse them: the GPU is in the other mode); a job asking for a whole
// GPU lands on another GPU, and one asking `device "nvidia/gpu.mps"` on a third, each
// task's environment showing its mode. Stopped, every GPU is free again.
func TestNomadAgentSharingModes(t *testing.T) {
	nomadBin := nomadBinary(t)
	bins := build(t)
	tmp := tempDir(t, "dhnmodes")
	mpsDir := filepath.Join(tempDir(t, "mps"), "d")
	cfgPath := filepath.Join(tmp, "agent.hcl")
	writeFile(t, cfgPath, strings.Replace(fmt.Sprintf(mpsAgentConfig, mpsDir), `sharing  = "mps"`, `sharing  = ["time-slicing", "mps"]`, 1))
	address := "unix://" + filepath.Join(tmp, "dh.sock")
	startAgent(t, bins[agentName], tmp, "agent", "-dev", "-listen", address, "-config", cfgPath, "-log-json")
	c := dial(t, address)

	ports := freePorts(t, 3)
	nomadAddr := "127.0.0.1:" + ports[0]
	cfg := writeNomadConfig(t, tmp, ports, bins[shim.BinaryName], address, nomadAddr, 2*time.Second, nomadOptions{})
	startAgent(t, nomadBin, tmp, "agent", "-config", cfg, "-log-level", "debug") // its output is logged if the test fails
	n := &nomadHTTP{t: t, addr: "http://" + nomadAddr}
	defer n.stopAll()
	nodeID := n.waitNodeWithGPUs(8)
	shared := "nvidia/gpu.shared/" + h100
	testwait.WaitFor(t, "32 replicas and 8 MPS share groups of 4 in Nomad's node status", func() bool {
		devs, err := n.nodeDevices(nodeID)
		groups := 0
		for name, ds := range devs {
			if strings.HasPrefix(name, "nvidia/gpu.mps/") && len(ds) == 4 {
				groups++
			}
		}
		return err == nil && groups == 8 && len(devs[shared]) == 32
	})

	// run starts job name on one device of device, and returns the GPU its task saw and
	// its MPS pipe directory.
	run := func(name, device string) (gpu, pipe string) {
		t.Helper()
		out := filepath.Join(tmp, name+".env")
		script := fmt.Sprintf(`printf '%%s|%%s\n' "$NVIDIA_VISIBLE_DEVICES" "$CUDA_MPS_PIPE_DIRECTORY" > %[1]s.tmp && mv %[1]s.tmp %[1]s && exec sleep 3600`, out)
		allocID := n.runBatchJob(nomadBin, tmp, name, script, device, 1)
		var line string
		testwait.WaitFor(t, "the environment of job "+name, func() bool {
			b, err := os.ReadFile(out)
			line = strings.TrimSpace(string(b))
			return err == nil
		})
		gpu, pipe, _ = strings.Cut(line, "|")
		r := waitActiveReservation(t, c, shim.AllocOwner("default", name, allocID, "train"))
		t.Logf("| %s | %s | %s | %v | pipe %q |", name, device, gpu, r.GetDeviceIds(), pipe)
		return gpu, pipe
	}
	// unavailable waits until every device of gpu's group of typ in Nomad's node status
	// is unhealthy.
	unavailable := func(gpu, typ string) {
		t.Helper()
		var desc string
		testwait.WaitFor(t, "GPU "+gpu+"'s "+typ+" devices unhealthy in Nomad's node status", func() bool {
			devs, err := n.nodeDevices(nodeID)
			if err != nil {
				return false
			}
			seen := 0
			for name, ds := range devs {
				if !strings.HasPrefix(name, "nvidia/"+typ+"/") {
					continue
				}
				for _, d := range ds {
					if strings.HasPrefix(d.ID, gpu) {
						if d.Healthy {
							return false
						}
						seen++
						desc = d.HealthDescription
					}
				}
			}
			return seen > 0
		})
		t.Logf("GPU %s's %s devices in Nomad: unhealthy, %q", gpu, typ, desc)
	}

	tsGPU, tsPipe := run("ts", "nvidia/gpu.shared")
	if !strings.HasPrefix(tsGPU, "GPU-") || tsPipe != "" {
		t.Fatalf("the time-sliced task saw GPU %q, MPS pipe %q; want a GPU without MPS", tsGPU, tsPipe)
	}
	unavailable(tsGPU, "gpu.mps")
	unavailable(tsGPU, "gpu")
	wholeGPU, _ := run("whole", "nvidia/gpu")
	if wholeGPU == tsGPU {
		t.Errorf("the whole-GPU job landed on %s, which the time-sliced job holds", tsGPU)
	}
	unavailable(wholeGPU, "gpu.mps")
	mpsGPU, mpsPipe := run("mps", "nvidia/gpu.mps")
	if mpsGPU == tsGPU || mpsGPU == wholeGPU || !strings.HasPrefix(mpsPipe, mpsDir+"/") {
		t.Errorf("the MPS job on %s with pipe %q; want a third GPU (not %s, %s) and a pipe under %s", mpsGPU, mpsPipe, tsGPU, wholeGPU, mpsDir)
	}
	for _, job := range []string{"ts", "whole", "mps"} {
		n.deleteJob(job)
	}
	testwait.WaitFor(t, "the daemon gone after the jobs stopped", func() bool {
		entries, err := os.ReadDir(mpsDir)
		return err == nil && len(entries) == 0
	})
}
