package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicehost/devicehost/endpoint"
)

// A config the plugin rejects is an error of the agent's config, said at the key the
// plugin names: at start the agent exits 1 with it; on SIGHUP the reload is refused
// with it.

// typoConfig's plugin block is on line 3 and its config has, on line 6, a key the
// nvidia-example plugin does not know, one edit pair away from "mig".
const typoConfig = `log_level = "info"

plugin "nvidia-example" {
  config {
    simulate = "dgxh100"
    mgi      = "on-demand"
  }
}
`

const typoFreeConfig = `log_level = "info"

plugin "nvidia-example" {
  config {
    simulate = "dgxh100"
  }
}
`

// writeTypoConfig writes content to an agent config file in a fresh directory and
// returns its path and a socket address beside it.
func writeTypoConfig(t *testing.T, content string) (string, endpoint.Address) {
	t.Helper()
	dir := tempDir(t, "dhtypo")
	path := filepath.Join(dir, "agent.hcl")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path, endpoint.Address{Network: "unix", Path: filepath.Join(dir, "dh.sock")}
}

func TestAgentExitsOnAPluginConfigTypo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	path, addr := writeTypoConfig(t, typoConfig)
	agent := startAgentProcess(t, addr, "agent", "-dev", "-config", path, "-listen", addr.String())

	err := agent.Wait(ctx)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("agent with a plugin config typo: %v, want exit status 1", err)
	}
	stderr := strings.Join(agent.Stderr.Lines(), "\n")
	want := path + `:6,5: Plugin config rejected; plugin "nvidia-example": config: json: unknown field "mgi" (did you mean "mig"?)`
	if !strings.Contains(stderr, want) {
		t.Errorf("stderr does not say %q:\n%s", want, stderr)
	}
	if !strings.Contains(stderr, "stopping plugin after it rejected its config: plugin=nvidia-example") {
		t.Errorf("stderr does not say why the plugin was stopped:\n%s", stderr)
	}
	if strings.Contains(stderr, "[ERROR]") {
		t.Errorf("stderr has ERROR lines, as if the plugin had crashed; the error is the exit's:\n%s", stderr)
	}
	// Nothing was served: the config was refused before the API began to answer.
	for _, served := range []string{"server: serving", "agent: listening", "devicehost agent -dev:"} {
		if out := stderr + "\n" + strings.Join(agent.Stdout.Lines(), "\n"); strings.Contains(out, served) {
			t.Errorf("the agent said %q before it exited on the rejected config:\n%s", served, out)
		}
	}
}

func TestAgentRefusesAReloadWithAPluginConfigTypo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	path, addr := writeTypoConfig(t, typoFreeConfig)
	agent := startAgentProcess(t, addr, "agent", "-dev", "-log-json", "-config", path, "-listen", addr.String())
	watchCtx, stopWatch := context.WithCancel(ctx) // the health watch: an open call would hold the agent's stop
	defer stopWatch()
	client := agent.client(t, watchCtx)
	_, before := healthyGPUs(t, ctx, client)
	pluginPID := childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example")

	if err := os.WriteFile(path, []byte(typoConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := agent.Cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	refused := agent.waitLog(t, ctx, "configuration reload refused; the running configuration is kept", nil)
	want := path + `:6,5: Plugin config rejected; plugin "nvidia-example": config: json: unknown field "mgi" (did you mean "mig"?)`
	if got := refused.str("error"); !strings.Contains(got, want) {
		t.Errorf("refusal error %q does not say %q", got, want)
	}
	if n := agent.logCount("configuration reloaded"); n != 0 {
		t.Errorf("%d lines say the configuration was reloaded, want 0", n)
	}
	// The running process checked the config (CheckConfig): no process was launched
	// with it, so none was stopped for rejecting it.
	if n := agent.logCount("stopping plugin after it rejected its config"); n != 0 {
		t.Errorf("%d plugin processes were launched with the refused config, want 0", n)
	}

	// The plugin that ran serves on, the same process, with the same devices.
	if got := childPID(t, agent.Cmd.Process.Pid, "plugin", "nvidia-example"); got != pluginPID {
		t.Errorf("plugin process %d, then %d: the refused reload restarted it", pluginPID, got)
	}
	if _, after := healthyGPUs(t, ctx, client); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("healthy GPUs after the refused reload: %v, want %v", after, before)
	}
	for _, l := range agent.Stderr.Lines() {
		if strings.Contains(l, `"@level":"error"`) && !strings.Contains(l, "configuration reload refused") {
			t.Errorf("ERROR line beside the refusal: %s", l)
		}
	}

	stopWatch()
	if err := agent.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := agent.Wait(ctx); err != nil {
		t.Errorf("agent exit after SIGTERM: %v, want 0", err)
	}
}
