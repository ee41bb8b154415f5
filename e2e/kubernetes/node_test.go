package kubernetes

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// enableEnv turns the suite on. Without it every test skips, so that `go test ./...` on a
// machine without the node (or without root) stays fast.
const enableEnv = "DEVICEHOST_E2E_K8S"

// node is the running node, as node.sh up describes it in its env file; nil when the suite
// is off.
var node *nodeEnv

// skipReason says why the suite does not run; empty when it does.
var skipReason string

type nodeEnv struct {
	vars        map[string]string
	root        string // the repository root
	run         string // DEVICEHOST_E2E_RUN: the node's state, removed at down
	logs        string // DEVICEHOST_E2E_LOGS: the logs, kept
	kubectlBin  string
	kubeconfig  string
	nodeName    string
	image       string
	kubeletRoot string
	cdiDir      string
	devicehost  string // the devicehost binary built for the suite
	nvidiaEx    string // the nvidia-example plugin binary built for the suite
	hostdev     string // the hostdev plugin binary built for the suite
	tuntap      string // the pods' static TUN check (e2e/kubernetes/tuntap), alone in its directory
}

func TestMain(m *testing.M) { os.Exit(runMain(m)) }

func runMain(m *testing.M) int {
	if os.Getenv(enableEnv) != "1" {
		skipReason = "the real-node suite is off: run e2e/kubernetes/run.sh, or set " + enableEnv +
			"=1 as root after e2e/kubernetes/build.sh (see docs/kubernetes.md)"
		return m.Run()
	}
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		fmt.Fprintf(os.Stderr, "%s=1: the real-node suite needs Linux and root\n", enableEnv)
		return 1
	}
	root, err := repoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	script := filepath.Join(root, "e2e", "kubernetes", "node.sh")
	t0 := time.Now()
	up := exec.Command("bash", script, "up")
	up.Stdout, up.Stderr = os.Stderr, os.Stderr
	if err := up.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "node.sh up: %v\n", err)
		downNode(script)
		return 1
	}
	defer downNode(script)
	fmt.Fprintf(os.Stderr, "e2e: node up in %v\n", time.Since(t0).Round(time.Millisecond))
	n, err := loadNodeEnv(root)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	t1 := time.Now()
	if err := n.buildDevicehost(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "e2e: devicehost and nvidia-example built in %v\n", time.Since(t1).Round(time.Millisecond))
	node = n
	return m.Run()
}

func downNode(script string) {
	down := exec.Command("bash", script, "down")
	down.Stdout, down.Stderr = os.Stderr, os.Stderr
	if err := down.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "node.sh down: %v\n", err)
	}
}

func repoRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("not inside the devicehost module")
	}
	return filepath.Dir(mod), nil
}

func loadNodeEnv(root string) (*nodeEnv, error) {
	run := os.Getenv("DEVICEHOST_E2E_RUN")
	if run == "" {
		run = "/var/lib/devicehost-e2e"
	}
	f, err := os.Open(filepath.Join(run, "env"))
	if err != nil {
		return nil, fmt.Errorf("the node's env file: %w", err)
	}
	defer f.Close()
	vars := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			vars[k] = v
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	n := &nodeEnv{
		vars:        vars,
		root:        root,
		run:         vars["DEVICEHOST_E2E_RUN"],
		logs:        vars["DEVICEHOST_E2E_LOGS"],
		kubectlBin:  vars["DEVICEHOST_E2E_KUBECTL"],
		kubeconfig:  vars["KUBECONFIG"],
		nodeName:    vars["DEVICEHOST_E2E_NODE"],
		image:       vars["DEVICEHOST_E2E_IMAGE"],
		kubeletRoot: vars["DEVICEHOST_E2E_KUBELET_ROOT"],
		cdiDir:      vars["DEVICEHOST_E2E_CDI_DIR"],
	}
	for k, v := range map[string]string{"run": n.run, "logs": n.logs, "kubectl": n.kubectlBin,
		"kubeconfig": n.kubeconfig, "node": n.nodeName, "image": n.image, "kubelet root": n.kubeletRoot, "cdi": n.cdiDir} {
		if v == "" {
			return nil, fmt.Errorf("the node's env file has no %s", k)
		}
	}
	return n, nil
}

// buildDevicehost builds the binaries the DaemonSet's image holds, under the node's run
// directory, where node.sh down finds their processes if a test left any.
//
// With -race, as buildDRA builds the DRA driver: the processes the suite runs on the
// host then stop on a data race as the unit tests do, and the build only links, since
// .ci/run's go vet -race and the unit tests have compiled every dependency that way (a
// plain build compiles them all again: the DRA driver's client-go took 3 min 18 s of a
// cold run). The images' binaries are plain builds (the Dockerfile's).
func (n *nodeEnv) buildDevicehost() error {
	dir := filepath.Join(n.run, "bin")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	n.devicehost = filepath.Join(dir, "devicehost")
	n.nvidiaEx = filepath.Join(dir, "nvidia-example")
	n.hostdev = filepath.Join(dir, "hostdev")
	for bin, pkg := range map[string]string{n.devicehost: "./cmd/devicehost", n.nvidiaEx: "./plugins/nvidia-example", n.hostdev: "./plugins/hostdev"} {
		cmd := exec.Command("go", "build", "-race", "-o", bin, pkg)
		cmd.Dir = n.root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		if os.Getenv("CGO_CFLAGS") == "" {
			cmd.Env = append(cmd.Env, "CGO_CFLAGS=-O2 -g -Wno-deprecated-declarations")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %w\n%s", pkg, err, out)
		}
	}
	// Static: it runs in the pods' busybox image, which has no C library.
	n.tuntap = filepath.Join(n.run, "tuntap", "tuntap")
	cmd := exec.Command("go", "build", "-o", n.tuntap, "./e2e/kubernetes/tuntap")
	cmd.Dir = n.root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./e2e/kubernetes/tuntap: %w\n%s", err, out)
	}
	return nil
}

// requireNode skips t when the suite is off and returns the node otherwise.
func requireNode(t *testing.T) *nodeEnv {
	t.Helper()
	if node == nil {
		t.Skip(skipReason)
	}
	return node
}

// nodeScript runs node.sh with args (stop kubelet, start kubelet, ...).
func (n *nodeEnv) nodeScript(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command("bash", append([]string{filepath.Join(n.root, "e2e", "kubernetes", "node.sh")}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("node.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("node.sh %s: %s", strings.Join(args, " "), bytes.TrimSpace(out))
}

// kubectl runs kubectl against the node's API server, bounded to 30 s.
func (n *nodeEnv) kubectl(stdin []byte, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, n.kubectlBin, append([]string{"--kubeconfig", n.kubeconfig}, args...)...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}

// kubectlWatch runs kubectl get args --watch -o json and hands each object it prints,
// decoded into a fresh T, to each (from its own goroutine) until each returns false,
// kubectl ends or stop is called, and then calls end; stop ends the watch and fails t
// if kubectl failed before it.
func kubectlWatch[T any](t *testing.T, n *nodeEnv, args []string, each func(ctx context.Context, v T) bool, end func()) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, n.kubectlBin, append(append([]string{"--kubeconfig", n.kubeconfig, "get"}, args...), "--watch", "-o", "json")...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer end()
		dec := json.NewDecoder(out)
		for {
			var v T
			if err := dec.Decode(&v); err != nil || !each(ctx, v) {
				return
			}
		}
	}()
	return func() {
		cancel()
		<-done
		if err := cmd.Wait(); err != nil && ctx.Err() == nil {
			t.Errorf("kubectl get --watch: %v: %s", err, bytes.TrimSpace(stderr.Bytes()))
		}
	}
}

// kubectlJSON runs kubectl ... -o json and decodes its answer into v.
func (n *nodeEnv) kubectlJSON(v any, args ...string) error {
	out, err := n.kubectl(nil, append(args, "-o", "json")...)
	if err != nil {
		return err
	}
	return json.Unmarshal(out, v)
}
