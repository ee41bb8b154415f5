// Package agenttest builds the devicehost binary once per test binary and runs it (or
// any program the tests run beside it, as the Nomad agent) as a real process, its
// output recorded. Tests of cmd/devicehost and of the Nomad and DRA modules use it.
package agenttest

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/devicehost/devicehost/tools/logtest"
)

// Module is the root module's path: Binary builds its ./cmd/devicehost in its
// directory, with its go.mod, as its own tests build it.
const Module = "github.com/devicehost/devicehost"

var built struct {
	once sync.Once
	dir  string
	path string
	err  error
}

// Binary builds devicehost from the root module, with -race when this program was
// built with it, the first time it is called in a test binary, and returns its path.
// It fails t if the build failed (each call does, once it has). The binary stays
// until RemoveBinary; a TestMain calls that after m.Run.
func Binary(t testing.TB) string {
	t.Helper()
	built.once.Do(func() { built.dir, built.path, built.err = build() })
	if built.err != nil {
		t.Fatalf("build devicehost: %v", built.err)
	}
	return built.path
}

func build() (dir, path string, err error) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		return "", "", err
	}
	// The root module's directory: this one, or the one the replace of a module that
	// requires it names.
	out, err := exec.Command(goTool, "list", "-m", "-f", "{{.Dir}}", Module).Output()
	if err != nil {
		return "", "", fmt.Errorf("go list -m %s: %w", Module, err)
	}
	root := strings.TrimSpace(string(out))
	dir, err = os.MkdirTemp("", "dhbin")
	if err != nil {
		return "", "", err
	}
	path = filepath.Join(dir, "devicehost")
	args := []string{"build", "-o", path}
	if Race {
		args = append(args, "-race")
	}
	cmd := exec.Command(goTool, append(args, "./cmd/devicehost")...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", "", fmt.Errorf("go %s (in %s): %w\n%s", strings.Join(cmd.Args[1:], " "), root, err, out)
	}
	return dir, path, nil
}

// RemoveBinary removes what Binary built, if it built anything.
func RemoveBinary() {
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
}

// Command is a program for Start to run.
type Command struct {
	Path string   // the binary, as from Binary
	Args []string // its arguments, after the program name
	// TempDir is the process's TMPDIR: a SIGKILLed `agent -dev` cannot remove its
	// temporary directory, so a test gives it one that the test removes. Empty means
	// the test's own TMPDIR.
	TempDir string
	// MergeOutput records stderr with stdout, in the order written, in Stdout (and
	// Stderr is the same Recorder); otherwise each has its own.
	MergeOutput bool
}

// Process is a program Start runs. Its fields are set by Start and not changed.
type Process struct {
	Cmd    *exec.Cmd
	Stdout *logtest.Recorder
	Stderr *logtest.Recorder // Stdout itself with MergeOutput
	exited chan struct{}
	err    error // cmd.Wait's result, set before exited closes
}

// Start runs c in a process group of its own and records its output until it exits.
// It fails t if the program cannot start. Cleanup SIGKILLs the group if the program
// still runs (the plugins of an agent die with it through their parent-death signal,
// unless kept for reattach), waits for it, and, if the test failed, logs its output.
func Start(t testing.TB, c Command) *Process {
	t.Helper()
	p := &Process{Stdout: &logtest.Recorder{}, exited: make(chan struct{})}
	p.Stderr = p.Stdout
	if !c.MergeOutput {
		p.Stderr = &logtest.Recorder{}
	}
	p.Cmd = exec.Command(c.Path, c.Args...)
	p.Cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if c.TempDir != "" {
		p.Cmd.Env = append(os.Environ(), "TMPDIR="+c.TempDir)
	}
	outPipe, err := p.Cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var errPipe io.Reader
	if c.MergeOutput {
		p.Cmd.Stderr = p.Cmd.Stdout
	} else if errPipe, err = p.Cmd.StderrPipe(); err != nil {
		t.Fatal(err)
	}
	if err := p.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		var wg sync.WaitGroup
		wg.Go(func() { p.Stdout.Consume(outPipe) })
		if errPipe != nil {
			wg.Go(func() { p.Stderr.Consume(errPipe) })
		}
		wg.Wait()
		p.err = p.Cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		p.Kill()
		if !t.Failed() {
			return
		}
		if c.MergeOutput {
			t.Logf("%s %v output:\n%s", filepath.Base(c.Path), c.Args, p.Stdout)
			return
		}
		t.Logf("%s %v stdout:\n%s", filepath.Base(c.Path), c.Args, p.Stdout)
		t.Logf("%s %v stderr:\n%s", filepath.Base(c.Path), c.Args, p.Stderr)
	})
	return p
}

// Exited returns a channel closed once the process has exited and its output is read.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Err is cmd.Wait's result once Exited is closed; nil before.
func (p *Process) Err() error {
	select {
	case <-p.exited:
		return p.err
	default:
		return nil
	}
}

// Wait waits until the process has exited, or ctx ends, and returns cmd.Wait's result
// or an error saying it still runs.
func (p *Process) Wait(ctx context.Context) error {
	select {
	case <-p.exited:
		return p.err
	case <-ctx.Done():
		return fmt.Errorf("%s still running: %w", filepath.Base(p.Cmd.Path), ctx.Err())
	}
}

// Kill SIGKILLs the process group, if the process still runs, and waits for it to
// exit.
func (p *Process) Kill() {
	select {
	case <-p.exited:
	default:
		syscall.Kill(-p.Cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
}
