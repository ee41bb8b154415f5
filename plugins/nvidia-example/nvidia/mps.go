package nvidia

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/backoff"
	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/deviceplugin/cdi"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// MPS shares. With sharing = "mps" and replicas = N, each whole GPU and each static MIG
// device is offered as N shares besides itself, each consuming 1/N of the device's
// memory and compute counters, so that the ledger keeps the whole device and its
// shares apart as it keeps MIG instances and their GPU apart. A held share is served by
// an MPS control daemon (nvidia-cuda-mps-control -f, a child of the plugin) whose pipe
// and log directories live under mps_dir:
//
//   - isolation "shared": one daemon per device, started by the first share's Reserve
//     and stopped by the last share's Release; every holder's limits are in its
//     environment (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT).
//   - isolation "per-holder": one daemon per holder (per Reserve), whose default limits
//     are the holder's shares, set through the control pipe before the answer: a
//     container that changes its environment cannot raise them.
//
// Each Reserve chooses its isolation (its option mps_isolation; the config's
// mps_isolation when it has none, among mps_isolation_allowed), so a device may be
// served by its shared daemon, in <mps_dir>/<device>/, and by per-holder daemons, in
// <mps_dir>/<device>/holder-<k>/, at once. A held share's isolation is its daemon's,
// and Reconcile rebuilds each live reservation's daemon with the isolation it asked.
//
// A holder's limits are what its shares give unless its Reserve lowers them (options
// mps_thread_percentage and mps_memory_limit; never above the shares', which the host
// counted): the lowered values are in its environment and, per-holder, its daemon's
// default limits, which Reconcile rebuilds from the options the host hands back.
//
// The plugin supervises each daemon: one that dies is restarted with the same
// directories and limits, and its shares are unhealthy, with the reason, until it is
// back. A daemon outlives the plugin process (its workloads use it); the next plugin
// finds it through the daemon.json beside its pipe directory and adopts it at
// Reconcile, or starts it again, and stops every daemon no live reservation holds.

// mpsSettings is the checked MPS part of the config; shares == 0 means MPS is off.
type mpsSettings struct {
	shares    int
	isolation string   // a Reserve's when it asks none
	allowed   []string // what a Reserve may ask (mps_isolation_allowed)
	dir       string
	control   string // nvidia-cuda-mps-control; "" for the default
}

// mpsLimits are what a holder may use of one device.
type mpsLimits struct {
	Threads int   `json:"threads"` // CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
	MemMiB  int64 `json:"mem_mib"` // the device's pinned memory limit
}

// Counter names of an MPS-shared device's counter set.
const (
	counterMPSMemory  = "mps-memory-mib"
	counterMPSCompute = "mps-compute-percent"
)

// mpsShare is what one of a device's n shares consumes and may use; nothing when
// there are none.
func mpsShare(deviceMemMiB int64, n int) mpsLimits {
	if n <= 0 {
		return mpsLimits{}
	}
	return mpsLimits{Threads: 100 / n, MemMiB: deviceMemMiB / int64(n)}
}

// times is k shares' limits.
func (l mpsLimits) times(k int) mpsLimits {
	return mpsLimits{Threads: l.Threads * k, MemMiB: l.MemMiB * int64(k)}
}

// counters is what the limits consume of the device's counter set.
func (l mpsLimits) counters() map[string]int64 {
	return map[string]int64{counterMPSMemory: l.MemMiB, counterMPSCompute: int64(l.Threads)}
}

// mpsShareID is the device ID of MPS share k of a GPU or MIG device.
func mpsShareID(deviceUUID string, k int) string { return fmt.Sprintf("%s::mps::%d", deviceUUID, k) }

// mpsDaemonFile is the record beside a daemon's pipe directory that lets the next
// plugin process find it.
const mpsDaemonFile = "daemon.json"

// mpsRecord is the content of mpsDaemonFile.
type mpsRecord struct {
	PID    int        `json:"pid"`
	Start  uint64     `json:"start"` // /proc/<pid>/stat starttime: the PID is that process
	Device string     `json:"device"`
	Limits *mpsLimits `json:"limits,omitempty"` // per-holder daemons' default limits
}

// Timings of the supervisor.
const (
	mpsReadyTimeout   = 10 * time.Second // a started daemon opens its control pipe
	mpsCommandTimeout = 5 * time.Second  // one control client run
	mpsQuitTimeout    = 5 * time.Second  // a daemon told to quit exits
	mpsAdoptedPoll    = 100 * time.Millisecond
	maxMPSOutput      = 64 << 10
)

// mpsSupervisor runs and supervises the control daemons of one mps_dir.
type mpsSupervisor struct {
	settings mpsSettings
	logger   hclog.Logger
	daemon   func() *exec.Cmd // a control daemon in the foreground
	client   func() *exec.Cmd // a control client
	restart  backoff.Backoff
	// deviceDirs memoises each device's directory name (a digest), off the Reserve path.
	deviceDirs sync.Map

	mu       sync.Mutex
	daemons  map[string]*mpsDaemon // by key, its directory under settings.dir
	byShare  map[string]*mpsDaemon
	stopping map[string]chan struct{} // keys whose daemon is still stopping
	changed  chan struct{}            // closed and replaced when a daemon goes down or up
	done     chan struct{}            // closed by close
	wg       sync.WaitGroup
}

// newMPSSupervisor resolves the control binary: mps_control, else the simulated one
// (this binary) with simulate, else nvidia-cuda-mps-control on the PATH.
func newMPSSupervisor(m mpsSettings, simulate bool, logger hclog.Logger) (*mpsSupervisor, error) {
	s := &mpsSupervisor{
		settings: m,
		logger:   logger.Named("mps"),
		restart:  backoff.Backoff{Base: 100 * time.Millisecond, Max: 5 * time.Second},
		daemons:  make(map[string]*mpsDaemon),
		byShare:  make(map[string]*mpsDaemon),
		stopping: make(map[string]chan struct{}),
		changed:  make(chan struct{}),
		done:     make(chan struct{}),
	}
	control := m.control
	switch {
	case control == "" && simulate:
		self, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("config: sharing = %q: the simulated MPS control daemon is this binary, which cannot be found: %w", SharingMPS, err)
		}
		s.daemon = func() *exec.Cmd { return simMPSCommand(self, "daemon") }
		s.client = func() *exec.Cmd { return simMPSCommand(self, "client") }
		return s, nil
	case control == "":
		path, err := exec.LookPath("nvidia-cuda-mps-control")
		if err != nil {
			return nil, fmt.Errorf("config: sharing = %q: nvidia-cuda-mps-control is not on the PATH (%v); install the CUDA MPS tools or set mps_control", SharingMPS, err)
		}
		control = path
	default:
		if fi, err := os.Stat(control); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return nil, fmt.Errorf("config: mps_control = %q: not an executable file", control)
		}
	}
	s.daemon = func() *exec.Cmd { return exec.Command(control, "-f") }
	s.client = func() *exec.Cmd { return exec.Command(control) }
	return s, nil
}

func simMPSCommand(self, role string) *exec.Cmd {
	c := exec.Command(self)
	c.Env = append(os.Environ(), simMPSEnv+"="+role)
	return c
}

// sameAs says whether the supervisor serves settings m (the share count and the
// allowed isolations aside: neither changes a running daemon).
func (s *mpsSupervisor) sameAs(m mpsSettings) bool {
	return s.settings.dir == m.dir && s.settings.control == m.control && s.settings.isolation == m.isolation
}

// active is how many daemons serve held shares.
func (s *mpsSupervisor) active() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.daemons)
}

// changes returns a channel closed at the next change of a daemon's health.
func (s *mpsSupervisor) changes() <-chan struct{} {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

func (s *mpsSupervisor) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// health says whether the daemon that serves share (of device) is up; a share no
// daemon serves is healthy, and so is one whose daemon is starting for the first time.
// A share no holder holds follows the device's shared daemon, when it has one: a
// Reserve of it with isolation "shared" would join that daemon.
func (s *mpsSupervisor) health(share, device string) (ok bool, reason string) {
	if s == nil {
		return true, ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.byShare[share]
	if d == nil {
		d = s.daemons[s.keyFor(device, nil, MPSShared)]
	}
	if d == nil || d.up || !d.wasUp {
		return true, ""
	}
	return false, d.reason
}

// mpsDaemon is one control daemon: its process is owned by its run goroutine.
type mpsDaemon struct {
	key     string
	device  string     // the device its shares divide: a GPU's or static MIG device's UUID, or a partition's ID
	visible string     // CUDA_VISIBLE_DEVICES: a GPU's or MIG device's UUID
	limits  *mpsLimits // per-holder: the daemon's default limits
	pipeDir string
	logDir  string
	after   chan struct{} // the previous daemon of this key has stopped
	adopt   bool          // try daemon.json before starting one

	ready    chan struct{} // closed when the first start finished; startErr then set
	startErr error
	stop     chan struct{} // closed to stop it
	finished chan struct{} // closed when run returned

	// Guarded by the supervisor's mu.
	shares map[string]bool
	up     bool
	wasUp  bool
	reason string
}

// keyFor is the key (the directory under mps_dir) of the daemon that serves shares of
// device with isolation: the device's own for "shared", the holder's for "per-holder".
func (s *mpsSupervisor) keyFor(device string, shares []string, isolation string) string {
	// The device's directory is a short digest of its UUID (daemon.json names the
	// device): control pipes under it must fit a Unix socket's 108 bytes.
	dir, ok := s.deviceDirs.Load(device)
	if !ok {
		sum := sha256.Sum256([]byte(device))
		dir, _ = s.deviceDirs.LoadOrStore(device, hex.EncodeToString(sum[:6]))
	}
	if isolation != MPSPerHolder {
		return dir.(string)
	}
	// One holder's shares are its own, so its lowest share names its daemon.
	low := -1
	for _, id := range shares {
		if k, err := strconv.Atoi(id[strings.LastIndex(id, ":")+1:]); err == nil && (low < 0 || k < low) {
			low = k
		}
	}
	return fmt.Sprintf("%s/holder-%d", dir, low)
}

// newDaemonLocked adds the daemon of key; the caller starts its run.
func (s *mpsSupervisor) newDaemonLocked(key, device, visible string, limits *mpsLimits, adopt bool) *mpsDaemon {
	dir := filepath.Join(s.settings.dir, key)
	d := &mpsDaemon{
		key: key, device: device, visible: visible, limits: limits, adopt: adopt,
		pipeDir: filepath.Join(dir, "pipe"), logDir: filepath.Join(dir, "log"),
		after: s.stopping[key], ready: make(chan struct{}), stop: make(chan struct{}),
		finished: make(chan struct{}), shares: make(map[string]bool),
	}
	s.daemons[key] = d
	s.wg.Go(func() { s.run(d) })
	return d
}

// mpsAnswer is what a holder of shares is told: the daemon's directories and its limits.
type mpsAnswer struct {
	pipeDir, logDir string
	limits          mpsLimits
}

// acquire serves shares (all of device, one holder's) with a daemon that is up, as
// isolation asks: the device's (shared), starting it when it is the first, or a new
// one of the holder's (per-holder). visible is the GPU or MIG device the daemon runs
// on; limits is what the shares add up to.
func (s *mpsSupervisor) acquire(ctx context.Context, device, visible string, shares []string, limits mpsLimits, isolation string) (mpsAnswer, error) {
	key := s.keyFor(device, shares, isolation)
	s.mu.Lock()
	d := s.daemons[key]
	switch {
	case d == nil:
		var own *mpsLimits
		if isolation == MPSPerHolder {
			own = &limits
		}
		d = s.newDaemonLocked(key, device, visible, own, false)
	case d.wasUp && !d.up:
		s.mu.Unlock()
		return mpsAnswer{}, fmt.Errorf("the MPS control daemon of %s is down (%s); it is being restarted", device, d.reason)
	}
	for _, id := range shares {
		d.shares[id] = true
		s.byShare[id] = d
	}
	s.mu.Unlock()

	var err error
	select {
	case <-d.ready:
		err = d.startErr
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		s.release(shares)
		return mpsAnswer{}, err
	}
	return mpsAnswer{pipeDir: d.pipeDir, logDir: d.logDir, limits: limits}, nil
}

// release ends shares; a daemon left with none is stopped before release returns.
// Shares no daemon serves are ignored.
func (s *mpsSupervisor) release(shares []string) {
	var stop []*mpsDaemon
	s.mu.Lock()
	for _, id := range shares {
		d := s.byShare[id]
		if d == nil {
			continue
		}
		delete(s.byShare, id)
		delete(d.shares, id)
		if len(d.shares) == 0 && s.daemons[d.key] == d {
			delete(s.daemons, d.key)
			s.stopping[d.key] = d.finished
			stop = append(stop, d)
		}
	}
	s.mu.Unlock()
	for _, d := range stop {
		close(d.stop)
		<-d.finished
	}
}

// mpsWant is a daemon that live reservations need.
type mpsWant struct {
	device  string // the divided device
	visible string // the GPU or MIG device it runs on
	shares  []string
	limits  *mpsLimits // per-holder
}

// serves says whether a daemon serves shares of device.
func (s *mpsSupervisor) serves(device string) bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.daemons {
		if d.device == device {
			return true
		}
	}
	return false
}

// reconcile makes the daemons match the live reservations' shares: each one wanted is
// adopted (its daemon.json names a live process) or started; every other daemon,
// running under this supervisor or left in mps_dir by an earlier plugin process, is
// stopped.
func (s *mpsSupervisor) reconcile(ctx context.Context, want map[string]mpsWant) error {
	var stop, wait []*mpsDaemon
	s.mu.Lock()
	for key, d := range s.daemons {
		if _, ok := want[key]; !ok {
			for id := range d.shares {
				delete(s.byShare, id)
			}
			delete(s.daemons, key)
			s.stopping[key] = d.finished
			stop = append(stop, d)
		}
	}
	for key, w := range want {
		d := s.daemons[key]
		if d == nil {
			d = s.newDaemonLocked(key, w.device, w.visible, w.limits, true)
			wait = append(wait, d)
		}
		for id := range d.shares {
			delete(s.byShare, id)
		}
		clear(d.shares)
		for _, id := range w.shares {
			d.shares[id] = true
			s.byShare[id] = d
		}
	}
	s.mu.Unlock()
	for _, d := range stop {
		close(d.stop)
		<-d.finished
	}
	errs := []error{s.stopStrays(want)}
	for _, d := range wait {
		select {
		case <-d.ready:
			if d.startErr != nil {
				errs = append(errs, d.startErr)
			}
		case <-ctx.Done():
			errs = append(errs, ctx.Err())
		}
	}
	return errors.Join(errs...)
}

// stopStrays stops the daemons that daemon.json files under mps_dir name but neither
// want nor this supervisor has, and removes their directories.
func (s *mpsSupervisor) stopStrays(want map[string]mpsWant) error {
	files, _ := filepath.Glob(filepath.Join(s.settings.dir, "*", mpsDaemonFile))
	more, _ := filepath.Glob(filepath.Join(s.settings.dir, "*", "*", mpsDaemonFile))
	var errs []error
	for _, f := range append(files, more...) {
		dir := filepath.Dir(f)
		key, err := filepath.Rel(s.settings.dir, dir)
		if err != nil {
			continue
		}
		s.mu.Lock()
		_, running := s.daemons[key]
		s.mu.Unlock()
		if _, wanted := want[key]; wanted || running {
			continue
		}
		rec, err := readMPSRecord(f)
		if err == nil && processAlive(rec.PID, rec.Start) {
			s.logger.Info("stopping an MPS control daemon no live reservation holds", "device", rec.Device, "pid", rec.PID, "dir", dir)
			s.quit(filepath.Join(dir, "pipe"), filepath.Join(dir, "log"))
			if !waitGone(rec.PID, rec.Start, mpsQuitTimeout) {
				_ = syscall.Kill(rec.PID, syscall.SIGKILL)
			}
		}
		if err := s.removeDir(dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeDir removes what a daemon keeps in its directory (its pipe and log
// directories, its record), then the directory and its device's directory when they
// are left empty: a device's shared daemon's directory holds its per-holder daemons'
// directories, which stay while those run.
func (s *mpsSupervisor) removeDir(dir string) error {
	for _, name := range []string{"pipe", "log", mpsDaemonFile, mpsDaemonFile + ".tmp"} {
		if err := os.RemoveAll(filepath.Join(dir, name)); err != nil {
			s.logger.Warn("MPS directory not removed", "dir", dir, "error", err)
			return fmt.Errorf("mps: removing %s: %w", dir, err)
		}
	}
	_ = os.Remove(dir) // fails while per-holder daemons of the device are under it
	if parent := filepath.Dir(dir); parent != s.settings.dir {
		_ = os.Remove(parent) // fails while another daemon of the device is there
	}
	return nil
}

// close stops supervising: the daemons keep running for their holders, and the next
// plugin process adopts them.
func (s *mpsSupervisor) close() {
	s.mu.Lock()
	select {
	case <-s.done:
	default:
		close(s.done)
	}
	n := len(s.daemons)
	s.mu.Unlock()
	s.wg.Wait()
	if n > 0 {
		s.logger.Info("MPS control daemons left running for their holders", "daemons", n)
	}
}

// mpsProc is a running daemon process.
type mpsProc struct {
	pid    int
	start  uint64
	exited chan struct{} // closed when it has exited
	status string        // how it exited, once exited is closed
}

// run owns daemon d's process: it starts (or adopts) it, restarts it while it is
// wanted, and stops it when d.stop closes.
func (s *mpsSupervisor) run(d *mpsDaemon) {
	defer close(d.finished)
	if d.after != nil {
		<-d.after
	}
	defer s.forget(d)
	var p *mpsProc
	var err error
	if d.adopt {
		p = s.adopt(d)
	}
	if p == nil {
		p, err = s.start(d)
	}
	d.startErr = err
	if err == nil {
		s.setUp(d, true, "")
	}
	close(d.ready)
	if err != nil {
		s.logger.Warn("MPS control daemon did not start", "device", d.device, "key", d.key, "error", err)
		s.removeDir(filepath.Dir(d.pipeDir))
		return
	}
	restarts := s.restart
	for {
		select {
		case <-s.done:
			return // the daemon keeps running for its holders
		case <-d.stop:
			s.stopProc(d, p)
			return
		case <-p.exited:
		}
		reason := fmt.Sprintf("MPS control daemon for %s exited (%s); restarting", d.device, p.status)
		s.logger.Warn("MPS control daemon exited; restarting it", "device", d.device, "key", d.key, "exit", p.status)
		s.setUp(d, false, reason)
		for p = nil; p == nil; {
			t := time.NewTimer(restarts.Next())
			select {
			case <-s.done:
				t.Stop()
				return
			case <-d.stop:
				t.Stop()
				s.removeDir(filepath.Dir(d.pipeDir))
				return
			case <-t.C:
			}
			if p, err = s.start(d); err != nil {
				s.setUp(d, false, fmt.Sprintf("MPS control daemon for %s does not start again: %v", d.device, err))
			}
		}
		restarts.Reset()
		s.logger.Info("MPS control daemon restarted", "device", d.device, "key", d.key, "pid", p.pid)
		s.setUp(d, true, "")
	}
}

func (s *mpsSupervisor) setUp(d *mpsDaemon, up bool, reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	changed := d.up != up || d.reason != reason
	d.up, d.reason = up, reason
	if up {
		d.wasUp = true
	}
	if changed && d.wasUp {
		s.notifyLocked()
	}
}

// forget drops d's stopping mark once its run has returned.
func (s *mpsSupervisor) forget(d *mpsDaemon) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping[d.key] == d.finished {
		delete(s.stopping, d.key)
	}
	if s.daemons[d.key] == d && d.startErr != nil {
		delete(s.daemons, d.key)
		for id := range d.shares {
			delete(s.byShare, id)
		}
	}
}

// start runs a daemon for d, waits until it answers on its control pipe, sets d's
// limits, and records it in daemon.json.
func (s *mpsSupervisor) start(d *mpsDaemon) (*mpsProc, error) {
	for _, dir := range []string{d.pipeDir, d.logDir} {
		// Holders' containers mount these, and their processes need not be root.
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("mps: %w", err)
		}
	}
	out, err := os.OpenFile(filepath.Join(d.logDir, "daemon.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("mps: %w", err)
	}
	defer out.Close()
	cmd := s.daemon()
	cmd.Env = append(envOr(cmd.Env), "CUDA_VISIBLE_DEVICES="+d.visible,
		"CUDA_MPS_PIPE_DIRECTORY="+d.pipeDir, "CUDA_MPS_LOG_DIRECTORY="+d.logDir)
	cmd.Stdout, cmd.Stderr = out, out
	// Its own process group: a signal meant for the agent's terminal does not end it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("mps: starting the control daemon for %s: %w", d.device, err)
	}
	p := &mpsProc{pid: cmd.Process.Pid, exited: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		p.status = "exit status 0"
		if err != nil {
			p.status = err.Error()
		}
		close(p.exited)
	}()
	p.start = processStart(p.pid)
	fail := func(err error) (*mpsProc, error) {
		_ = cmd.Process.Kill()
		<-p.exited
		return nil, fmt.Errorf("mps: the control daemon for %s: %w%s", d.device, err, tailOf(filepath.Join(d.logDir, "daemon.out")))
	}
	if err := s.waitReady(d, p); err != nil {
		return fail(err)
	}
	if d.limits != nil {
		if err := s.setLimits(d); err != nil {
			return fail(err)
		}
	}
	rec := mpsRecord{PID: p.pid, Start: p.start, Device: d.visible, Limits: d.limits}
	if err := writeMPSRecord(filepath.Join(filepath.Dir(d.pipeDir), mpsDaemonFile), rec); err != nil {
		return fail(err)
	}
	s.logger.Info("MPS control daemon started", "device", d.device, "key", d.key, "pid", p.pid, "pipe_dir", d.pipeDir)
	return p, nil
}

// envOr is env, or the process's environment when nil (exec.Cmd's rule).
func envOr(env []string) []string {
	if env != nil {
		return env
	}
	return os.Environ()
}

// waitReady waits until the daemon's control pipe exists and it answers a query.
func (s *mpsSupervisor) waitReady(d *mpsDaemon, p *mpsProc) error {
	deadline := time.Now().Add(mpsReadyTimeout)
	for {
		if _, err := os.Stat(filepath.Join(d.pipeDir, "control")); err == nil {
			if _, err := s.command(d.pipeDir, d.logDir, "get_default_active_thread_percentage"); err == nil {
				return nil
			} else if time.Now().After(deadline) {
				return err
			}
		}
		select {
		case <-p.exited:
			return fmt.Errorf("exited at start (%s)", p.status)
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no control pipe in %s after %s", d.pipeDir, mpsReadyTimeout)
		}
	}
}

// setLimits sets a per-holder daemon's default limits and reads them back.
func (s *mpsSupervisor) setLimits(d *mpsDaemon) error {
	l := *d.limits
	out, err := s.command(d.pipeDir, d.logDir,
		fmt.Sprintf("set_default_active_thread_percentage %d", l.Threads),
		fmt.Sprintf("set_default_device_pinned_mem_limit 0 %dM", l.MemMiB),
		"get_default_active_thread_percentage",
		"get_default_device_pinned_mem_limit 0")
	if err != nil {
		return err
	}
	lines := strings.Fields(out)
	if len(lines) < 2 {
		return fmt.Errorf("setting its limits: unexpected answer %q", out)
	}
	threads, terr := strconv.ParseFloat(lines[len(lines)-2], 64)
	mem, merr := parseMiB(lines[len(lines)-1])
	if terr != nil || merr != nil || int(threads) != l.Threads || mem != l.MemMiB {
		return fmt.Errorf("setting its limits to %d%% and %d MiB: it answered %q", l.Threads, l.MemMiB, out)
	}
	return nil
}

// parseMiB reads a pinned memory limit as the control daemon prints it ("4096M", "4G").
func parseMiB(v string) (int64, error) {
	if len(v) < 2 {
		return 0, fmt.Errorf("memory limit %q", v)
	}
	n, err := strconv.ParseInt(v[:len(v)-1], 10, 64)
	if err != nil {
		return 0, err
	}
	switch v[len(v)-1] {
	case 'M':
		return n, nil
	case 'G':
		return n << 10, nil
	}
	return 0, fmt.Errorf("memory limit %q", v)
}

// command runs the control client with commands on its stdin and returns what it
// printed.
func (s *mpsSupervisor) command(pipeDir, logDir string, commands ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), mpsCommandTimeout)
	defer cancel()
	cmd := s.client()
	c := exec.CommandContext(ctx, cmd.Path, cmd.Args[1:]...)
	c.Env = append(envOr(cmd.Env), "CUDA_MPS_PIPE_DIRECTORY="+pipeDir, "CUDA_MPS_LOG_DIRECTORY="+logDir)
	c.Stdin = strings.NewReader(strings.Join(commands, "\n") + "\n")
	var out boundedBuffer
	out.max = maxMPSOutput
	c.Stdout, c.Stderr = &out, &out
	if err := c.Run(); err != nil {
		return "", fmt.Errorf("control client %q: %w: %s", commands, err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// quit asks the daemon of pipeDir to quit; it does not wait for it.
func (s *mpsSupervisor) quit(pipeDir, logDir string) {
	if _, err := s.command(pipeDir, logDir, "quit"); err != nil {
		s.logger.Debug("MPS control daemon did not take quit", "pipe_dir", pipeDir, "error", err)
	}
}

// stopProc stops d's daemon: quit, then SIGKILL if it has not exited in time; then its
// directories go.
func (s *mpsSupervisor) stopProc(d *mpsDaemon, p *mpsProc) {
	s.quit(d.pipeDir, d.logDir)
	t := time.NewTimer(mpsQuitTimeout)
	select {
	case <-p.exited:
	case <-t.C:
		s.logger.Warn("MPS control daemon did not quit in time; killing it", "device", d.device, "pid", p.pid)
		if processAlive(p.pid, p.start) {
			_ = syscall.Kill(p.pid, syscall.SIGKILL)
		}
		<-p.exited
	}
	t.Stop()
	s.removeDir(filepath.Dir(d.pipeDir))
	s.logger.Info("MPS control daemon stopped", "device", d.device, "key", d.key)
}

// adopt takes over the daemon that daemon.json names, when it is alive and its limits
// are d's; nil otherwise (one that does not match is stopped).
func (s *mpsSupervisor) adopt(d *mpsDaemon) *mpsProc {
	file := filepath.Join(filepath.Dir(d.pipeDir), mpsDaemonFile)
	rec, err := readMPSRecord(file)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			s.logger.Warn("MPS daemon record unreadable; starting a new daemon", "file", file, "error", err)
		}
		return nil
	}
	if !processAlive(rec.PID, rec.Start) {
		return nil
	}
	if rec.Device != d.visible || !equalLimits(rec.Limits, d.limits) {
		s.logger.Warn("MPS control daemon serves other limits; replacing it", "device", d.device, "pid", rec.PID)
		s.quit(d.pipeDir, d.logDir)
		if !waitGone(rec.PID, rec.Start, mpsQuitTimeout) {
			_ = syscall.Kill(rec.PID, syscall.SIGKILL)
			waitGone(rec.PID, rec.Start, mpsQuitTimeout)
		}
		return nil
	}
	p := &mpsProc{pid: rec.PID, start: rec.Start, exited: make(chan struct{})}
	s.wg.Go(func() {
		t := time.NewTicker(mpsAdoptedPoll)
		defer t.Stop()
		for {
			select {
			case <-s.done:
				return
			case <-d.finished:
				return
			case <-t.C:
				if !processAlive(p.pid, p.start) {
					p.status = "no longer running"
					close(p.exited)
					return
				}
			}
		}
	})
	s.logger.Info("adopted a running MPS control daemon", "device", d.device, "key", d.key, "pid", rec.PID)
	return p
}

func equalLimits(a, b *mpsLimits) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}

func readMPSRecord(path string) (mpsRecord, error) {
	var rec mpsRecord
	raw, err := os.ReadFile(path)
	if err != nil {
		return rec, err
	}
	if len(raw) > 4096 {
		return rec, fmt.Errorf("%s: %d bytes, more than a daemon record holds", path, len(raw))
	}
	if err := json.Unmarshal(raw, &rec); err != nil {
		return rec, fmt.Errorf("%s: %w", path, err)
	}
	if rec.PID <= 1 || rec.Start == 0 {
		return rec, fmt.Errorf("%s: no process named", path)
	}
	return rec, nil
}

func writeMPSRecord(path string, rec mpsRecord) error {
	raw, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o644); err != nil {
		return fmt.Errorf("mps: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("mps: %w", err)
	}
	return nil
}

// processStart is the start time of process pid in clock ticks since boot (field 22 of
// /proc/<pid>/stat), which tells a PID that was reused apart; 0 when unreadable.
func processStart(pid int) uint64 {
	_, start := procStat(pid)
	return start
}

// procStat returns the state and start time of pid; "" when it has none.
func procStat(pid int) (state string, start uint64) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", 0
	}
	// The command name (field 2) may hold spaces and parentheses: fields are counted
	// after its last ")".
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 {
		return "", 0
	}
	f := strings.Fields(string(raw[i+1:]))
	if len(f) < 20 {
		return "", 0
	}
	start, _ = strconv.ParseUint(f[19], 10, 64)
	return f[0], start
}

// processAlive says whether pid is still the process that started at start, and not a
// zombie.
func processAlive(pid int, start uint64) bool {
	state, s := procStat(pid)
	return state != "" && state != "Z" && state != "X" && s == start
}

// waitGone waits up to d for the process to be gone.
func waitGone(pid int, start uint64, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for processAlive(pid, start) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

// tailOf is the end of a daemon's output file, for an error ("" when empty).
func tailOf(path string) string {
	raw, err := os.ReadFile(path)
	if err != nil || len(bytes.TrimSpace(raw)) == 0 {
		return ""
	}
	if len(raw) > 512 {
		raw = raw[len(raw)-512:]
	}
	return fmt.Sprintf(" (its output ends: %q)", strings.TrimSpace(string(raw)))
}

// boundedBuffer keeps the first max bytes written to it.
type boundedBuffer struct {
	bytes.Buffer
	max int
}

func (b *boundedBuffer) Write(p []byte) (int, error) {
	if room := b.max - b.Len(); room > 0 {
		b.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

// mpsEnv is what a holder's container is told: the daemon's directories and its limits.
func (a mpsAnswer) env() map[string]string {
	return map[string]string{
		"CUDA_MPS_PIPE_DIRECTORY":           a.pipeDir,
		"CUDA_MPS_LOG_DIRECTORY":            a.logDir,
		"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": strconv.Itoa(a.limits.Threads),
		"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":  fmt.Sprintf("0=%dM", a.limits.MemMiB),
	}
}

// mpsRequest picks the MPS shares out of a Reserve's device IDs: none, or all of them
// shares of one device. A container's CUDA_MPS_PIPE_DIRECTORY names one daemon, so
// shares of two devices, or shares with other devices, are refused.
func mpsRequest(inv *inventory, ids []string) (shares []string, device string, err error) {
	var others []string
	devs := make(map[string]bool)
	for _, id := range ids {
		if t := inv.targets[id]; t.kind == targetMPS {
			shares = append(shares, id)
			devs[t.divides] = true
			device = t.divides
		} else {
			others = append(others, id)
		}
	}
	switch {
	case len(shares) == 0:
		return nil, "", nil
	case len(others) > 0:
		return nil, "", status.Errorf(codes.InvalidArgument, "reserve: MPS shares (%s) cannot be reserved with other devices (%s): a container's MPS pipe directory names one device's daemon",
			strings.Join(shares, ", "), strings.Join(others, ", "))
	case len(devs) > 1:
		return nil, "", status.Errorf(codes.InvalidArgument, "reserve: MPS shares of %d devices (%s): a container's MPS pipe directory names one device's daemon; reserve shares of one device",
			len(devs), strings.Join(slices.Sorted(maps.Keys(devs)), ", "))
	}
	return shares, device, nil
}

// reserveShares answers a Reserve of MPS shares of device with isolation: its daemon
// up (started if need be), the holder's limits (k shares: k times one's, lowered by
// the options mps_thread_percentage and mps_memory_limit) in its environment and, with
// per-holder isolation, as its daemon's default limits, and the daemon's directories
// mounted. Shares of an on-demand placement
// have its MIG instance made first, when no other share has; it goes again when the
// daemon cannot start.
func (rt *runtime) reserveShares(ctx context.Context, inv *inventory, device string, shares []string, isolation string, options map[string]string) (*pb.ContainerReservation, error) {
	t := inv.targets[shares[0]]
	limits, err := limitsOf(inv, shares, options)
	if err != nil {
		return nil, err
	}
	visible := t.uuid
	if t.onDemand() {
		rt.migMu.Lock()
		defer rt.migMu.Unlock()
		g := inv.gpus[t.gpu]
		uuid, created, err := createPartition(g, t.profile, t.placement)
		if err != nil {
			return nil, rt.partitionRefusal(inv, shares, t, err)
		}
		visible = uuid
		if created {
			rt.publishCDILocked(inv)
		}
		defer func() {
			if !rt.mpsSup.serves(device) {
				// The daemon did not start and no other holder's shares keep the instance.
				if err := destroyPartition(g, t.profile, t.placement.Start); err != nil {
					rt.logger.Warn("MIG instance of a refused MPS share not destroyed", "device", device, "error", err)
				}
				rt.publishCDILocked(inv)
			}
		}()
	}
	ans, err := rt.mpsSup.acquire(ctx, device, visible, shares, limits, isolation)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "reserve %s: %v", strings.Join(shares, ", "), err)
	}
	envs := ans.env()
	envs["NVIDIA_VISIBLE_DEVICES"] = visible
	names := make([]string, 0, len(shares))
	for _, id := range shares {
		names = append(names, cdi.Name(cdiKind, id))
	}
	return &pb.ContainerReservation{
		Envs: envs,
		Mounts: []*pb.Mount{
			{HostPath: ans.pipeDir, ContainerPath: ans.pipeDir},
			{HostPath: ans.logDir, ContainerPath: ans.logDir},
		},
		CdiDevices: names,
	}, nil
}

// mpsWants are the daemons the live reservations' MPS shares need, each with the
// isolation its reservation asked (its option mps_isolation, else the config's): one
// per device for the shared ones, and one per reservation and device (per-holder) with
// that holder's limits (its options mps_thread_percentage and mps_memory_limit
// applied). partitions gives the MIG device UUID of each on-demand
// placement whose instance exists, by partition ID.
func (rt *runtime) mpsWants(inv *inventory, live []deviceplugin.LiveReservation, partitions map[string]string) map[string]mpsWant {
	want := make(map[string]mpsWant)
	for _, r := range live {
		byDevice := make(map[string][]string)
		for _, id := range r.DeviceIDs {
			if t, ok := inv.targets[id]; ok && t.kind == targetMPS {
				byDevice[t.divides] = append(byDevice[t.divides], id)
			}
		}
		for device, shares := range byDevice {
			visible := inv.targets[shares[0]].uuid
			if visible == "" {
				if visible = partitions[device]; visible == "" {
					continue // its instance could not be made: Reconcile says so
				}
			}
			isolation := rt.isolationOf(r.Options)
			key := rt.mpsSup.keyFor(device, shares, isolation)
			w := want[key]
			w.device, w.visible = device, visible
			w.shares = append(w.shares, shares...)
			if isolation == MPSPerHolder {
				l, err := limitsOf(inv, shares, r.Options)
				if err != nil {
					// Its Reserve was accepted with other shares (the config changed):
					// the holder keeps what its shares give.
					rt.logger.Warn("MPS limits of a live reservation no longer fit its shares; its daemon gets the shares' limits", "reservation", r.ID, "error", err)
					l = inv.targets[shares[0]].mps.times(len(shares))
				}
				w.limits = &l
			}
			want[key] = w
		}
	}
	return want
}

// The Reserve options of MPS shares.
const (
	// optionMPSIsolation chooses a reservation's MPS isolation.
	optionMPSIsolation = "mps_isolation"
	// optionMPSThreads lowers a holder's thread percentage below its shares'.
	optionMPSThreads = "mps_thread_percentage"
	// optionMPSMemory lowers a holder's pinned memory limit (MiB) below its shares'.
	optionMPSMemory = "mps_memory_limit"
)

// isolationOf is the MPS isolation a reservation with options asked: its option
// mps_isolation, else the config's mps_isolation. Reserve refused any other value.
func (rt *runtime) isolationOf(options map[string]string) string {
	if v, ok := options[optionMPSIsolation]; ok && (v == MPSShared || v == MPSPerHolder) {
		return v
	}
	return rt.mps.isolation
}

// limitsOf is what the holder of shares (MPS shares of one device) may use: what the
// shares give (k shares: k times one's), lowered by its options mps_thread_percentage
// (an integer percentage) and mps_memory_limit (an integer number of MiB). A value
// that is not such an integer, below 1, or above what the shares give is refused with
// INVALID_ARGUMENT naming the option: a holder may lower its limits, never raise them,
// since the shares are what the host counted.
func limitsOf(inv *inventory, shares []string, options map[string]string) (mpsLimits, error) {
	t := inv.targets[shares[0]]
	entitled := t.mps.times(len(shares))
	got := entitled
	var errs []error
	if v, ok := options[optionMPSThreads]; ok {
		n, err := strconv.Atoi(v)
		switch {
		case err != nil || n < 1 || n > 100:
			errs = append(errs, status.Errorf(codes.InvalidArgument, "reserve: option %s = %q: want an integer percentage from 1 to 100", optionMPSThreads, v))
		case n > entitled.Threads:
			errs = append(errs, status.Errorf(codes.InvalidArgument, "reserve: option %s = %d is above %d, what the holder's %s; a holder may lower its limits, not raise them",
				optionMPSThreads, n, entitled.Threads, sharesGive(len(shares), t.divides)))
		default:
			got.Threads = n
		}
	}
	if v, ok := options[optionMPSMemory]; ok {
		n, err := strconv.ParseInt(v, 10, 64)
		switch {
		case err != nil || n < 1:
			errs = append(errs, status.Errorf(codes.InvalidArgument, "reserve: option %s = %q: want an integer number of MiB, at least 1", optionMPSMemory, v))
		case n > entitled.MemMiB:
			errs = append(errs, status.Errorf(codes.InvalidArgument, "reserve: option %s = %d (MiB) is above %d, what the holder's %s; a holder may lower its limits, not raise them",
				optionMPSMemory, n, entitled.MemMiB, sharesGive(len(shares), t.divides)))
		default:
			got.MemMiB = n
		}
	}
	switch len(errs) {
	case 0:
		return got, nil
	case 1:
		return mpsLimits{}, errs[0]
	}
	msgs := make([]string, len(errs))
	for i, err := range errs {
		msgs[i] = strings.TrimPrefix(status.Convert(err).Message(), "reserve: ")
	}
	return mpsLimits{}, status.Error(codes.InvalidArgument, "reserve: "+strings.Join(msgs, "; "))
}

// sharesGive is "1 MPS share of <device> gives" or "k MPS shares of <device> give".
func sharesGive(k int, device string) string {
	if k == 1 {
		return "1 MPS share of " + device + " gives"
	}
	return fmt.Sprintf("%d MPS shares of %s give", k, device)
}

// checkOptions refuses, with INVALID_ARGUMENT naming the option, what a Reserve of
// ids asks that the plugin cannot honour, before anything is prepared: an option other
// than mps_isolation, mps_thread_percentage and mps_memory_limit; an isolation other
// than "shared" and "per-holder"; any of them on devices that are not MPS shares
// (naming their type); an isolation the config's mps_isolation_allowed leaves out; and
// limits limitsOf refuses. shares are the request's MPS shares (mpsRequest).
func (rt *runtime) checkOptions(inv *inventory, ids, shares []string, options map[string]string) error {
	if err := deviceplugin.UnknownOptions(Name, options, optionMPSIsolation, optionMPSThreads, optionMPSMemory); err != nil {
		return err
	}
	v, isolation := options[optionMPSIsolation]
	if isolation && v != MPSShared && v != MPSPerHolder {
		return status.Errorf(codes.InvalidArgument, "reserve: option %s = %q: want %q or %q", optionMPSIsolation, v, MPSShared, MPSPerHolder)
	}
	if len(shares) == 0 {
		for _, key := range []string{optionMPSIsolation, optionMPSThreads, optionMPSMemory} {
			if _, ok := options[key]; ok {
				return status.Errorf(codes.InvalidArgument, "reserve: option %s applies to MPS shares only; %s is %s", key, ids[0], inv.targets[ids[0]].kind)
			}
		}
		return nil
	}
	if isolation && !slices.Contains(rt.mps.allowed, v) {
		return status.Errorf(codes.InvalidArgument, "reserve: option %s = %q is not allowed by the plugin's config (mps_isolation_allowed = %s)", optionMPSIsolation, v, quoteList(rt.mps.allowed))
	}
	_, err := limitsOf(inv, shares, options)
	return err
}
