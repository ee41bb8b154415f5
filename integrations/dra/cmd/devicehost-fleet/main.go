// Command devicehost-fleet is the fleet bench's client (scripts/fleet starts the control
// plane and kwok, then runs it): it makes N simulated nodes for kwok, publishes for each
// the ResourceSlices devicehost's DRA driver would publish for a DGX H100 (through the
// driver's own slice code and publisher, dra.PublishPool), then creates a burst of pods,
// each with a ResourceClaim, and measures how fast the scheduler binds them. It prints
// one row: the nodes, the layout, the claim, the pods, claims scheduled per second, p50
// and p99 from a pod's create to its nodeName set, the API server's and the scheduler's
// CPU seconds and peak RSS during the burst, the bytes of every ResourceSlice (their
// JSON, as listed), and the machine's highest load1 during the burst.
//
// With -writes it then runs every node's pool through the driver's publish loop
// (dra.RunPool) and counts the requests its client makes, at rest and under a churn of
// reservations (writes.go): a WRITES line for each phase.
//
//	devicehost-fleet -kubeconfig admin.kubeconfig -nodes 100 -layout static -pods 200 \
//	    -apiserver-pid 1234 -scheduler-pid 1240 -writes 60s
//
// Layouts, each 8 GPUs a node:
//
//	plain   the 8 GPUs with their IDs and NUMA nodes alone (no attributes but the
//	        driver's own, no counters): the floor any driver pays
//	static  devicehost's slices of the 8 whole GPUs, as the agent's -dev fingerprint
//	mig     devicehost's on-demand MIG layout: the 8 GPUs and their 224 placements,
//	        consuming the GPUs' counter sets
//	mig-trimmed the same with the plugin's mig_profiles = ["1g.10gb", "3g.40gb",
//	        "7g.80gb"]: the 8 GPUs and their 80 placements of those profiles
//	mig-first what publishing placements on demand would start from: the mig layout
//	        with each GPU's first placement of each profile alone (the 8 GPUs and 56
//	        placements), the scheduler's floor for that design (a what-if: the
//	        driver does not publish it; docs/benchmarks.md, "Fleet")
//	sharing the 8 GPUs offered whole, in 4 time-sliced replicas each and as 4 MPS
//	        shares each (replicas = 4, sharing = ["time-slicing", "mps"]), the MPS
//	        shares of a GPU published as one device of consumable memory
//
// The fingerprints are recorded from the agent (fingerprints/): `devicehost devices
// -json` of `devicehost agent -dev` (dgxh100.json), of the same with the nvidia-example
// plugin's config { simulate = "dgxh100", mig = "on-demand" } (dgxh100-mig-on-demand.json),
// of the same with mig_profiles (dgxh100-mig-trimmed.json), of the same with { simulate =
// "dgxh100", replicas = 4, sharing = ["time-slicing", "mps"], mps_dir = ... }
// (dgxh100-sharing.json), and dgxh100.json with each device's ID, health and NUMA node alone, no group
// attributes, no counter sets (dgxh100-plain.json). The DeviceClasses are deploy/kubernetes/dra.yaml's,
// which scripts/fleet applies.
package main

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/encoding/protojson"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/devicehost/devicehost/integrations/dra"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

//go:embed fingerprints/*.json
var fingerprints embed.FS

// kwok manages the nodes that carry this annotation (scripts/fleet starts it with
// --manage-nodes-with-annotation-selector).
const kwokAnnotation = "kwok.x-k8s.io/node"

const namespace = "fleet"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "devicehost-fleet:", err)
		os.Exit(1)
	}
}

type options struct {
	kubeconfig   string
	nodes        int
	layout       string
	claim        string
	pods         int
	apiserverPID int
	schedulerPID int
	parallel     int
	timeout      time.Duration
	// writes is how long each phase of the driver's writes lasts (0: not measured);
	// churnInterval how often a node's reservations change in the churn phases.
	writes        time.Duration
	churnInterval time.Duration
	// profileURL is the scheduler's CPU profile endpoint, fetched for profileSeconds from
	// the burst's start into profileFile ("": none).
	profileURL, profileFile string
	profileSeconds          int
}

func run(ctx context.Context, args []string) error {
	var o options
	fs := flag.NewFlagSet("devicehost-fleet", flag.ContinueOnError)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "admin kubeconfig `file` of the fleet's API server")
	fs.IntVar(&o.nodes, "nodes", 100, "simulated nodes")
	fs.StringVar(&o.layout, "layout", "static", "slice layout: plain, static, mig, mig-trimmed, mig-first or sharing")
	fs.StringVar(&o.claim, "claim", "gpu", "each pod's claim: gpu (1 GPU), gpu2 (2 GPUs of one NUMA node: matchAttribute), mig (one 1g.10gb; a mig layout) or mps (an MPS share of 20Gi; layout sharing)")
	fs.StringVar(&o.profileURL, "scheduler-profile-url", "", "the scheduler's /debug/pprof/profile `URL` (its secure port; the kubeconfig's client certificate is shown, its serving certificate not checked)")
	fs.StringVar(&o.profileFile, "scheduler-profile", "", "write the scheduler's CPU profile of the burst to this `file` (with -scheduler-profile-url)")
	fs.IntVar(&o.profileSeconds, "scheduler-profile-seconds", 10, "how long the profile runs from the burst's start")
	fs.IntVar(&o.pods, "pods", 0, "pods in the burst (0: 2 per node)")
	fs.IntVar(&o.apiserverPID, "apiserver-pid", 0, "the API server's PID, for its CPU and RSS (0: not measured)")
	fs.IntVar(&o.schedulerPID, "scheduler-pid", 0, "the scheduler's PID, for its CPU and RSS (0: not measured)")
	fs.DurationVar(&o.writes, "writes", 0, "after the burst, run every node's pool through the driver's publish loop and count its requests for this long at rest, then as long under each churn (0: not measured)")
	fs.DurationVar(&o.churnInterval, "churn-interval", 5*time.Second, "in the churn phases, a reservation made or released on each node this often")
	fs.IntVar(&o.parallel, "parallel", 32, "API calls in flight while setting up and in the burst")
	fs.DurationVar(&o.timeout, "timeout", 5*time.Minute, "how long the burst may take to be scheduled")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.pods == 0 {
		o.pods = 2 * o.nodes
	}
	snap, err := fingerprint(o.layout)
	if err != nil {
		return err
	}
	switch {
	case o.claim == "mig" && !strings.HasPrefix(o.layout, "mig"):
		return errors.New("-claim mig needs -layout mig, mig-trimmed or mig-first")
	case o.claim == "mps" && o.layout != "sharing":
		return errors.New("-claim mps needs -layout sharing")
	case o.claim != "gpu" && o.claim != "gpu2" && o.claim != "mig" && o.claim != "mps":
		return fmt.Errorf("-claim %q: want gpu, gpu2, mig or mps", o.claim)
	case o.writes > 0 && o.churnInterval <= 0:
		return errors.New("-churn-interval: want a duration above 0")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return err
	}
	// One client for the whole fleet: its drivers' rate limits are theirs each, not
	// one process's.
	cfg.QPS, cfg.Burst = 5000, 5000
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	t := time.Now()
	if err := createNodes(ctx, kube, o); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "fleet: %d nodes Ready in %.1fs\n", o.nodes, time.Since(t).Seconds())
	t = time.Now()
	writes, err := publish(ctx, kube, o, snap)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "fleet: %d ResourceSlices published in %.1fs\n", writes, time.Since(t).Seconds())
	sliceBytes, nslices, err := slicesBytes(ctx, kube)
	if err != nil {
		return err
	}
	var profile func() func() error
	if o.profileURL != "" && o.profileFile != "" {
		profile = func() func() error { return profileScheduler(ctx, cfg, o) }
	}
	res, err := burst(ctx, kube, o, profile)
	if err != nil {
		return err
	}
	fmt.Printf("ROW %d %s %s %d %d %.1f %.3f %.3f %.1f %.0f %.1f %.0f %d %d %.2f\n", o.nodes, o.layout, o.claim, o.pods, res.scheduled,
		res.perSecond, res.p50.Seconds(), res.p99.Seconds(), res.apiserver.cpu, res.apiserver.rssMiB,
		res.scheduler.cpu, res.scheduler.rssMiB, nslices, sliceBytes, res.load1)
	if o.writes > 0 {
		phases, err := measureWrites(ctx, cfg, o, snap)
		if err != nil {
			return fmt.Errorf("the drivers' writes: %w", err)
		}
		for _, p := range phases {
			fmt.Println(p)
		}
	}
	return nil
}

// profileScheduler fetches the scheduler's CPU profile of the next o.profileSeconds
// into o.profileFile, with cfg's client certificate; the function it returns waits for
// that.
func profileScheduler(ctx context.Context, cfg *rest.Config, o options) func() error {
	done := make(chan error, 1)
	go func() {
		done <- func() error {
			tlsCfg, err := rest.TLSConfigFor(cfg)
			if err != nil {
				return err
			}
			tlsCfg.RootCAs, tlsCfg.InsecureSkipVerify = nil, true // the scheduler's own serving certificate, on localhost
			c := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsCfg}, Timeout: time.Duration(o.profileSeconds+30) * time.Second}
			u := fmt.Sprintf("%s?seconds=%d", o.profileURL, o.profileSeconds)
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
			if err != nil {
				return err
			}
			resp, err := c.Do(req)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
				return fmt.Errorf("%s: %s: %q", u, resp.Status, msg)
			}
			f, err := os.Create(o.profileFile)
			if err != nil {
				return err
			}
			if _, err := io.Copy(f, resp.Body); err != nil {
				f.Close()
				return err
			}
			return f.Close()
		}()
	}()
	return func() error { return <-done }
}

// fingerprint returns the agent's snapshot of a node for layout, as protojson.
func fingerprint(layout string) ([]byte, error) {
	file := map[string]string{"plain": "dgxh100-plain.json", "static": "dgxh100.json", "mig": "dgxh100-mig-on-demand.json",
		"mig-first": "dgxh100-mig-on-demand.json", "mig-trimmed": "dgxh100-mig-trimmed.json", "sharing": "dgxh100-sharing.json"}[layout]
	if file == "" {
		return nil, fmt.Errorf("-layout %q: want plain, static, mig, mig-first, mig-trimmed or sharing", layout)
	}
	raw, err := fingerprints.ReadFile("fingerprints/" + file)
	if err != nil || layout != "mig-first" {
		return raw, err
	}
	return firstPlacements(raw)
}

// firstPlacements keeps, of the MIG placements of a snapshot (protojson), each GPU's
// first of each profile (the lowest ID: the lowest start) and drops the rest.
func firstPlacements(raw []byte) ([]byte, error) {
	snap := &pb.FingerprintResponse{}
	if err := protojson.Unmarshal(raw, snap); err != nil {
		return nil, err
	}
	for _, g := range snap.GetGroups() {
		if g.GetType() != "mig" {
			continue
		}
		first := make(map[string]*pb.Device) // by the GPU's counter set
		for _, d := range g.GetDevices() {
			if len(d.GetConsumes()) != 1 {
				return nil, fmt.Errorf("placement %s consumes %d counter sets, want 1", d.GetId(), len(d.GetConsumes()))
			}
			set := d.GetConsumes()[0].GetCounterSet()
			if f := first[set]; f == nil || d.GetId() < f.GetId() {
				first[set] = d
			}
		}
		g.Devices = slices.SortedFunc(maps.Values(first), func(a, b *pb.Device) int { return strings.Compare(a.GetId(), b.GetId()) })
	}
	return protojson.Marshal(snap)
}

func nodeName(i int) string { return fmt.Sprintf("fleet-%04d", i) }

// createNodes makes the nodes for kwok and waits until kwok has made them all Ready.
func createNodes(ctx context.Context, kube kubernetes.Interface, o options) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(o.parallel)
	for i := range o.nodes {
		g.Go(func() error {
			n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{
				Name:        nodeName(i),
				Annotations: map[string]string{kwokAnnotation: "fake"},
				Labels:      map[string]string{"type": "kwok", "kubernetes.io/hostname": nodeName(i)},
			}}
			_, err := kube.CoreV1().Nodes().Create(gctx, n, metav1.CreateOptions{})
			if err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("node %s: %w", n.Name, err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	deadline := time.Now().Add(3 * time.Minute)
	for {
		list, err := kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: "type=kwok"})
		if err != nil {
			return err
		}
		ready := 0
		for _, n := range list.Items {
			for _, c := range n.Status.Conditions {
				if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
					ready++
				}
			}
		}
		if ready >= o.nodes {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d nodes Ready after 3m: is kwok running?", ready, o.nodes)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// publish writes every node's pool as the driver on that node would.
func publish(ctx context.Context, kube kubernetes.Interface, o options, snap []byte) (int, error) {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(o.parallel)
	var mu sync.Mutex
	total := 0
	var problems []string
	for i := range o.nodes {
		g.Go(func() error {
			w, p, err := dra.PublishPool(gctx, kube, nil, dra.DefaultDriverName, nodeName(i), snap, nil)
			mu.Lock()
			defer mu.Unlock()
			total += w
			if i == 0 {
				problems = p
			}
			if err != nil {
				return fmt.Errorf("node %s: %w", nodeName(i), err)
			}
			return nil
		})
	}
	err := g.Wait()
	if len(problems) > 0 {
		fmt.Fprintf(os.Stderr, "fleet: the driver's problems with node 0's fingerprint (%d), first: %s\n", len(problems), problems[0])
	}
	return total, err
}

// slicesBytes is the JSON size of every ResourceSlice, as the API server lists them.
func slicesBytes(ctx context.Context, kube kubernetes.Interface) (bytes, n int, err error) {
	list, err := kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0, 0, err
	}
	for i := range list.Items {
		b, err := json.Marshal(&list.Items[i])
		if err != nil {
			return 0, 0, err
		}
		bytes += len(b)
	}
	return bytes, len(list.Items), nil
}

type result struct {
	scheduled int
	perSecond float64
	p50, p99  time.Duration
	// The API server's and the scheduler's CPU seconds and peak RSS during the burst.
	apiserver, scheduler usage
	load1                float64 // the machine's highest load1 during the burst
}

// burst creates the claims, then the pods all at once, and waits until the scheduler
// has bound them all (or o.timeout). profile (nil: none) starts as the pods are
// created, and what it returns is waited for at the end.
func burst(ctx context.Context, kube kubernetes.Interface, o options, profile func() func() error) (result, error) {
	_, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return result{}, err
	}
	// The claims first, not timed: the burst is the scheduler's.
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(o.parallel)
	for i := range o.pods {
		g.Go(func() error {
			_, err := kube.ResourceV1().ResourceClaims(namespace).Create(gctx, claim(o.claim, i), metav1.CreateOptions{})
			if err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("claim %d: %w", i, err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return result{}, err
	}

	var (
		mu        sync.Mutex
		created   = make(map[string]time.Time, o.pods)
		scheduled = make(map[string]time.Time, o.pods)
		all       = make(chan struct{})
	)
	seen := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.Spec.NodeName == "" {
			return
		}
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		if _, done := scheduled[p.Name]; done {
			return
		}
		scheduled[p.Name] = now
		if len(scheduled) == o.pods {
			close(all)
		}
	}
	f := informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithNamespace(namespace))
	inf := f.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    seen,
		UpdateFunc: func(_, obj any) { seen(obj) },
	}); err != nil {
		return result{}, err
	}
	ictx, stop := context.WithCancel(ctx)
	defer stop()
	f.Start(ictx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return result{}, ctx.Err()
	}

	sampler := startSampler(o.apiserverPID, o.schedulerPID)
	if profile != nil {
		wait := profile()
		defer func() {
			if err := wait(); err != nil {
				fmt.Fprintf(os.Stderr, "fleet: the scheduler's profile: %v\n", err)
			}
		}()
	}
	start := time.Now()
	g, gctx = errgroup.WithContext(ctx)
	g.SetLimit(o.parallel)
	for i := range o.pods {
		g.Go(func() error {
			p := pod(i)
			t := time.Now()
			mu.Lock()
			created[p.Name] = t
			mu.Unlock()
			if _, err := kube.CoreV1().Pods(namespace).Create(gctx, p, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("pod %d: %w", i, err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return result{}, err
	}
	select {
	case <-all:
	case <-time.After(o.timeout):
	case <-ctx.Done():
		return result{}, ctx.Err()
	}
	use, load1 := sampler.stop()

	mu.Lock()
	defer mu.Unlock()
	var lat []time.Duration
	var last time.Time
	for name, t := range scheduled {
		lat = append(lat, t.Sub(created[name]))
		if t.After(last) {
			last = t
		}
	}
	r := result{scheduled: len(scheduled), apiserver: use[0], scheduler: use[1], load1: load1}
	if len(lat) > 0 {
		slices.Sort(lat)
		r.p50 = lat[len(lat)/2]
		r.p99 = lat[min(len(lat)-1, len(lat)*99/100)]
		r.perSecond = float64(len(lat)) / last.Sub(start).Seconds()
	}
	return r, nil
}

// claim is claim i of kind: one GPU, two GPUs of one NUMA node (the simulated
// machines' GPUs have no NVLink domain, and their PCIe roots are not in this host's
// /sys), one 1g.10gb MIG device, or 20Gi of one GPU's MPS shares (as the real-node
// suite's MPS claims: consumable capacity of the GPU's pooled shares).
func claim(kind string, i int) *resourceapi.ResourceClaim {
	req := resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.devicehost.io", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}
	var constraints []resourceapi.DeviceConstraint
	switch kind {
	case "gpu2":
		req.Count = 2
		constraints = []resourceapi.DeviceConstraint{{MatchAttribute: new(resourceapi.FullyQualifiedName("resource.kubernetes.io/numaNode"))}}
	case "mig":
		req.DeviceClassName = "mig.devicehost.io"
		req.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: `device.attributes["devicehost.io"].productName == "1g.10gb"`}}}
	case "mps":
		req.DeviceClassName = "gpu-mps.devicehost.io"
		req.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{
			"memory": resource.MustParse("20Gi")}}
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("claim-%05d", i), Namespace: namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests:    []resourceapi.DeviceRequest{{Name: "dev", Exactly: &req}},
			Constraints: constraints,
		}},
	}
}

// pod is pod i, with claim i.
func pod(i int) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%05d", i), Namespace: namespace},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{
				Name: "c", Image: "fleet.invalid/none",
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")},
					Claims:   []corev1.ResourceClaim{{Name: "dev"}},
				},
			}},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "dev", ResourceClaimName: new(fmt.Sprintf("claim-%05d", i))}},
		},
	}
}

// usage is a process's CPU seconds over a span and its peak RSS in MiB.
type usage struct{ cpu, rssMiB float64 }

// sampler reads processes' CPU time and RSS from /proc, and the machine's load1.
type sampler struct {
	pids []int
	cpu0 []float64
	done chan struct{}
	wg   sync.WaitGroup
	// written by the sampling goroutine until stop
	peak  []float64 // MiB, by pid
	load1 float64
}

// startSampler samples pids (0: none, its usage zero) every 100 ms until stop.
func startSampler(pids ...int) *sampler {
	s := &sampler{pids: pids, cpu0: make([]float64, len(pids)), peak: make([]float64, len(pids)), done: make(chan struct{})}
	for i, pid := range pids {
		if pid != 0 {
			s.cpu0[i] = cpuSeconds(pid)
		}
	}
	s.wg.Go(func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			for i, pid := range pids {
				if pid != 0 {
					s.peak[i] = max(s.peak[i], rssMiB(pid))
				}
			}
			s.load1 = max(s.load1, load1())
			select {
			case <-s.done:
				return
			case <-tick.C:
			}
		}
	})
	return s
}

// stop ends the sampling: each pid's CPU seconds since start and peak RSS, and the
// highest load1 seen.
func (s *sampler) stop() ([]usage, float64) {
	close(s.done)
	s.wg.Wait()
	out := make([]usage, len(s.pids))
	for i, pid := range s.pids {
		if pid != 0 {
			out[i] = usage{cpu: cpuSeconds(pid) - s.cpu0[i], rssMiB: s.peak[i]}
		}
	}
	return out, s.load1
}

// load1 is the machine's load average over a minute (0 if unknown).
func load1() float64 {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(raw))
	if len(f) == 0 {
		return 0
	}
	l, _ := strconv.ParseFloat(f[0], 64)
	return l
}

// cpuSeconds is utime+stime of pid (USER_HZ is 100 on Linux).
func cpuSeconds(pid int) float64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseFloat(f[11], 64)
	k, _ := strconv.ParseFloat(f[12], 64)
	return (u + k) / 100
}

func rssMiB(pid int) float64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}
