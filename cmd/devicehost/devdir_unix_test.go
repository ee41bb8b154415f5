//go:build unix

package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/manager/ledger"
)

// mkdir makes dir (and parents) or fails the test.
func mkdir(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

// lockFile opens path (creating it) and holds an exclusive flock on it until cleanup,
// as a running agent or bbolt does.
func lockFile(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatal(err)
	}
}

func TestCleanDeadDevDirs(t *testing.T) {
	tmp := tempDir(t, "dhdev") // short: sockets go in it
	dead := mkdir(t, filepath.Join(tmp, devDirPrefix+"1dead"))
	if err := os.WriteFile(filepath.Join(dead, devLockName), nil, 0o600); err != nil { // its agent died holding it
		t.Fatal(err)
	}
	mkdir(t, filepath.Join(dead, devStateName, "sockets"))
	oldEmpty := mkdir(t, filepath.Join(tmp, devDirPrefix+"2old")) // an older agent's, SIGKILLed
	staleSock := mkdir(t, filepath.Join(tmp, devDirPrefix+"3stale"))
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(staleSock, devSocketName), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close() // the socket file stays, nobody accepts on it

	live, release, err := makeDevDir(tmp) // a running agent of this version
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	listening := mkdir(t, filepath.Join(tmp, devDirPrefix+"4listening")) // an older agent, running
	lis, err := net.Listen("unix", filepath.Join(listening, devSocketName))
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	ledgerOpen := mkdir(t, filepath.Join(tmp, devDirPrefix+"5ledger")) // an older agent with -listen elsewhere
	mkdir(t, filepath.Join(ledgerOpen, devStateName))
	lockFile(t, filepath.Join(ledgerOpen, devStateName, ledger.DefaultFileName))
	notOurs := mkdir(t, filepath.Join(tmp, "devicehost-other"))
	if err := os.WriteFile(filepath.Join(tmp, devDirPrefix+"file"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	target := mkdir(t, filepath.Join(tempDir(t, "dhtarget"), "precious"))
	if err := os.Symlink(target, filepath.Join(tmp, devDirPrefix+"link")); err != nil {
		t.Fatal(err)
	}

	removed, err := cleanDeadDevDirs(tmp)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(removed)
	if want := []string{dead, oldEmpty, staleSock}; !slices.Equal(removed, want) {
		t.Errorf("removed %q, want %q", removed, want)
	}
	for _, p := range []string{dead, oldEmpty, staleSock} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still there (%v)", p, err)
		}
	}
	for _, p := range []string{live, filepath.Join(live, devLockName), listening, ledgerOpen, notOurs,
		filepath.Join(tmp, devDirPrefix+"file"), filepath.Join(tmp, devDirPrefix+"link"), target} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s was removed: %v", p, err)
		}
	}
}

func TestMakeDevDirSurvivesACleanUpUnderIt(t *testing.T) {
	tmp := tempDir(t, "dhdev")
	var first string
	devDirMadeHook = func(dir string) {
		if first == "" {
			first = dir
			// Another agent's clean-up sees it before it is locked, finds it dead, and
			// removes it.
			if removed, err := cleanDeadDevDirs(tmp); err != nil || !slices.Equal(removed, []string{dir}) {
				t.Errorf("clean-up removed %q, %v; want %s", removed, err, dir)
			}
		}
	}
	defer func() { devDirMadeHook = nil }()
	dir, release, err := makeDevDir(tmp)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if dir == first {
		t.Fatalf("makeDevDir returned %s, which was removed", dir)
	}
	if fi, err := os.Stat(filepath.Join(dir, devLockName)); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("lock file: %v, %v", fi, err)
	}
	devDirMadeHook = nil
	if removed, _ := cleanDeadDevDirs(tmp); len(removed) != 0 {
		t.Errorf("clean-up removed %q of a live agent", removed)
	}
}

func TestDevAgentCleansUpAfterAKilledOne(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the devicehost binary")
	}
	tmp := tempDir(t, "dhkill")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	banner := regexp.MustCompile(`\((\S+) is removed on exit\)`)
	devDir := func(t *testing.T, a *agentProcess) string {
		t.Helper()
		l, err := a.Stdout.Wait(ctx, banner.MatchString)
		if err != nil {
			t.Fatalf("no dev banner: %v", err)
		}
		return banner.FindStringSubmatch(l)[1]
	}
	first := startAgentProcessIn(t, tmp, endpoint.Address{}, "agent", "-dev", "-log-json")
	firstDir := devDir(t, first)
	if err := syscall.Kill(-first.Cmd.Process.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-first.Exited()
	if _, err := os.Stat(firstDir); err != nil {
		t.Fatalf("a SIGKILLed agent removed its directory?: %v", err)
	}
	second := startAgentProcessIn(t, tmp, endpoint.Address{}, "agent", "-dev", "-log-json")
	secondDir := devDir(t, second)
	if _, err := os.Stat(firstDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the killed agent's %s is still there after a new -dev start (%v)", firstDir, err)
	}
	if _, err := os.Stat(secondDir); err != nil {
		t.Errorf("the running agent's directory: %v", err)
	}
	// Its banner's grpcurl examples use the socket it made there.
	sock := filepath.Join(secondDir, devSocketName)
	if l, err := second.Stdout.Wait(ctx, func(l string) bool { return strings.Contains(l, "grpcurl ") }); err != nil || !strings.Contains(l, " -unix "+sock+" ") {
		t.Errorf("banner's grpcurl line %q (%v), want it on -unix %s", l, err, sock)
	} else if fi, err := os.Stat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Errorf("%s, the banner's socket: %v, %v; want a socket", sock, fi, err)
	}
	found := false
	for _, l := range second.Stderr.Lines() {
		found = found || (strings.Contains(l, "no longer running") && strings.Contains(l, firstDir))
	}
	if !found {
		t.Errorf("the new agent did not log that it removed %s", firstDir)
	}
}
