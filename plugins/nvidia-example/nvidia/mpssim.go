package nvidia

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The simulated MPS control daemon. With simulate (and no mps_control), the plugin runs
// its own binary with simMPSEnv set in place of nvidia-cuda-mps-control: "daemon" is
// the control daemon in the foreground (the real one's -f); "client" is the control
// client, reading commands from stdin and printing the daemon's answers, as the real
// one does without arguments.
// The plugin drives both exactly as it drives the real ones (mps.go), so every test of
// MPS sharing runs without a GPU.
//
// It keeps the real daemon's rules that the plugin depends on: one daemon per pipe
// directory (a second one exits, saying an instance of the daemon is already running),
// the control socket at <pipe dir>/control, its log at <log dir>/control.log, and the
// commands the plugin sends: get/set_default_active_thread_percentage,
// get/set_default_device_pinned_mem_limit and quit. Unlike the real one it also exits
// when its control socket (or its pipe directory) is removed, so that a test that fails cannot leave one behind.

// simMPSEnv, set to "daemon" or "client", makes the plugin binary the simulated
// nvidia-cuda-mps-control in that role, whatever its arguments.
const simMPSEnv = "DEVICEHOST_SIM_MPS_CONTROL"

// maxMPSLine bounds one command or answer line of the control protocol.
const maxMPSLine = 4096

// RunSimulatedMPSIfAsked runs the simulated nvidia-cuda-mps-control and exits the
// process when simMPSEnv asks for it; otherwise it returns at once. Every binary that
// serves this plugin calls it first (Main does), and so do its tests' TestMain.
func RunSimulatedMPSIfAsked() {
	role := os.Getenv(simMPSEnv)
	if role == "" {
		return
	}
	os.Exit(simMPSMain(role, os.Stdin, os.Stdout, os.Stderr))
}

func simMPSMain(role string, stdin io.Reader, stdout, stderr io.Writer) int {
	pipeDir := cmpOr(os.Getenv("CUDA_MPS_PIPE_DIRECTORY"), "/tmp/nvidia-mps")
	logDir := cmpOr(os.Getenv("CUDA_MPS_LOG_DIRECTORY"), "/var/log/nvidia-mps")
	switch role {
	case "daemon":
		if err := simMPSDaemon(pipeDir, logDir); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		return 0
	case "client":
		if err := simMPSClient(pipeDir, stdin, stdout); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		return 0
	default:
		fmt.Fprintf(stderr, "simulated nvidia-cuda-mps-control: %s=%q: want daemon or client\n", simMPSEnv, role)
		return 2
	}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// simMPSDaemon serves the control socket until quit, SIGTERM or its pipe directory
// goes.
func simMPSDaemon(pipeDir, logDir string) error {
	lockFile, err := os.OpenFile(filepath.Join(pipeDir, "control_lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("simulated MPS control daemon: %w", err)
	}
	defer lockFile.Close()
	if err := syscall.Flock(int(lockFile.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return errors.New("simulated MPS control daemon: an instance of this daemon is already running in " + pipeDir)
	}
	logf, err := os.OpenFile(filepath.Join(logDir, "control.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("simulated MPS control daemon: %w", err)
	}
	defer logf.Close()
	logLine := func(format string, a ...any) {
		fmt.Fprintf(logf, "[%s] %s\n", time.Now().Format("2006-01-02 15:04:05.000"), fmt.Sprintf(format, a...))
	}
	sock := filepath.Join(pipeDir, "control")
	_ = os.Remove(sock) // a dead daemon's; the lock says none runs
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("simulated MPS control daemon: %w", err)
	}
	logLine("Control daemon started (simulated), CUDA_VISIBLE_DEVICES=%s", os.Getenv("CUDA_VISIBLE_DEVICES"))

	d := &simMPSState{threads: 100, memLimits: make(map[string]string), quit: make(chan struct{})}
	var conns sync.WaitGroup
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Go(func() { d.serve(c, logLine) })
		}
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	reason := ""
	for reason == "" {
		select {
		case <-d.quit:
			reason = "quit"
		case s := <-sigs:
			reason = "signal " + s.String()
		case <-tick.C:
			if _, err := os.Stat(sock); err != nil {
				reason = "control socket gone"
			}
		}
	}
	ln.Close()
	conns.Wait()
	logLine("Control daemon exiting: %s", reason)
	return nil
}

// simMPSState is what the simulated daemon's commands set.
type simMPSState struct {
	mu        sync.Mutex
	threads   float64
	memLimits map[string]string
	quit      chan struct{}
	quitOnce  sync.Once
}

var simMemLimit = regexp.MustCompile(`^[0-9]+[MG]$`)

// serve answers one client connection: one answer line per command line.
func (d *simMPSState) serve(c net.Conn, logLine func(string, ...any)) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	sc := bufio.NewScanner(c)
	sc.Buffer(make([]byte, 0, 256), maxMPSLine)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		answer := d.command(strings.Fields(line))
		logLine("Command: %q -> %q", line, answer)
		if _, err := fmt.Fprintln(c, answer); err != nil {
			return
		}
		if line == "quit" {
			return
		}
	}
}

func (d *simMPSState) command(f []string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case len(f) == 1 && f[0] == "quit":
		d.quitOnce.Do(func() { close(d.quit) })
		return ""
	case len(f) == 1 && f[0] == "get_default_active_thread_percentage":
		return strconv.FormatFloat(d.threads, 'f', 1, 64)
	case len(f) == 2 && f[0] == "set_default_active_thread_percentage":
		v, err := strconv.ParseFloat(f[1], 64)
		if err != nil || v <= 0 || v > 100 {
			return fmt.Sprintf("Invalid value %q: want a percentage above 0, at most 100", f[1])
		}
		d.threads = v
		return strconv.FormatFloat(v, 'f', 1, 64)
	case len(f) == 2 && f[0] == "get_default_device_pinned_mem_limit":
		return cmpOr(d.memLimits[f[1]], "0")
	case len(f) == 3 && f[0] == "set_default_device_pinned_mem_limit":
		if !simMemLimit.MatchString(f[2]) {
			return fmt.Sprintf("Invalid memory limit %q: want a number with M or G", f[2])
		}
		d.memLimits[f[1]] = f[2]
		return ""
	default:
		return fmt.Sprintf("Unrecognized command %q", strings.Join(f, " "))
	}
}

// simMPSClient sends each line of stdin to the daemon and prints its answers.
func simMPSClient(pipeDir string, stdin io.Reader, stdout io.Writer) error {
	c, err := net.DialTimeout("unix", filepath.Join(pipeDir, "control"), 5*time.Second)
	if err != nil {
		return fmt.Errorf("simulated MPS control client: cannot find the MPS control daemon: %w", err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	answers := bufio.NewScanner(c)
	answers.Buffer(make([]byte, 0, 256), maxMPSLine)
	in := bufio.NewScanner(stdin)
	in.Buffer(make([]byte, 0, 256), maxMPSLine)
	for in.Scan() {
		line := strings.TrimSpace(in.Text())
		if line == "" {
			continue
		}
		if _, err := fmt.Fprintln(c, line); err != nil {
			return err
		}
		if !answers.Scan() {
			if line == "quit" {
				return nil
			}
			return fmt.Errorf("the MPS control daemon closed the connection after %q: %v", line, answers.Err())
		}
		if a := answers.Text(); a != "" {
			fmt.Fprintln(stdout, a)
		}
	}
	return in.Err()
}
