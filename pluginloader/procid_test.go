package pluginloader

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"testing"
)

func TestProcessIdentity(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	id, err := IdentifyProcess(os.Getpid(), self)
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	if err := id.Check(); err != nil {
		t.Errorf("this process against its own identity: %v", err)
	}

	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skipf("no sleep: %v", err)
	}
	cmd := exec.Command(sleep, "600")
	if err := cmd.Start(); err != nil {
		t.Skipf("no sleep: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	child, err := IdentifyProcess(cmd.Process.Pid, sleep)
	if err != nil {
		t.Fatal(err)
	}

	wrong := []struct {
		name string
		edit func(p *ProcessIdentity)
		want string
	}{
		{"another boot", func(p *ProcessIdentity) { p.BootID = "another-boot" }, "rebooted"},
		{"PID reused", func(p *ProcessIdentity) { p.StartTicks++ }, "another process"},
		{"another binary", func(p *ProcessIdentity) { p.Path = self }, "not the plugin binary"},
	}
	for _, tc := range wrong {
		p := child
		tc.edit(&p)
		if err := p.Check(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Check = %v, want an error about %q", tc.name, err, tc.want)
		}
		// Never signalled: its PID may be someone else's.
		if killed, err := p.KillIfSame(); killed || err != nil {
			t.Errorf("%s: KillIfSame = %v, %v; want false, nil", tc.name, killed, err)
		}
	}
	if err := child.Check(); err != nil {
		t.Fatalf("the child after the failed checks: %v, want it alive and unsignalled", err)
	}

	if killed, err := child.KillIfSame(); !killed || err != nil {
		t.Fatalf("KillIfSame of the child = %v, %v; want true, nil", killed, err)
	}
	_ = cmd.Wait()
	// Gone, or (should its PID be reused at once) another process.
	if err := child.Check(); err == nil || !strings.Contains(err.Error(), "is gone") && !strings.Contains(err.Error(), "another process") {
		t.Errorf("Check after the child was killed and reaped = %v, want it gone", err)
	}
	if _, err := readProc(0); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("readProc(0) = %v, want ErrNotExist", err)
	}
}
