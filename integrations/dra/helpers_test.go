package dra

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"
	drahealthpb "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerpb "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/server/servertest"
	"github.com/devicehost/devicehost/tools/agenttest"
	"github.com/devicehost/devicehost/tools/logtest"
	"github.com/devicehost/devicehost/tools/proc"
	"github.com/devicehost/devicehost/tools/testwait"
)

const (
	testNode   = "node-a"
	testDriver = "devicehost.io"
)

func TestMain(m *testing.M) {
	code := m.Run()
	agenttest.RemoveBinary()
	if code == 0 {
		// The driver, its kubelet servers and its client start goroutines: none may
		// outlive the test that started it.
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// rig is one node: a real agent -dev with a durable state dir, a fake API server
// holding the node, and the kubelet's directories.
type rig struct {
	t                              testing.TB
	dir, sock, state               string
	pluginDir, registryDir, cdiDir string
	agent                          *agenttest.Process // stdout and stderr in Stdout
	c                              *client.Client     // the test's own client of the agent
	kube                           *fake.Clientset
	// staleHook, if set when a driver starts, sees its stale-claim rounds.
	staleHook func(staleRound)
	agentArgs []string // more arguments of the agent
	// updateHook, if set when a driver starts, is its beforeUpdate.
	updateHook func()
}

func newRig(t testing.TB) *rig {
	t.Helper()
	return newRigArgs(t)
}

// newRigArgs is newRig with the agent given more arguments (a -config).
func newRigArgs(t testing.TB, agentArgs ...string) *rig {
	t.Helper()
	dir := servertest.ShortTempDir(t, "dra")
	r := &rig{t: t, dir: dir, sock: filepath.Join(dir, "dh.sock"), state: filepath.Join(dir, "state"),
		pluginDir: filepath.Join(dir, "plugins", testDriver), registryDir: filepath.Join(dir, "reg"), cdiDir: filepath.Join(dir, "cdi"),
		agentArgs: agentArgs}
	for _, d := range []string{r.pluginDir, r.registryDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	r.startAgent()
	r.c = r.dial()
	r.kube = newKube()
	return r
}

func (r *rig) address() string { return "unix://" + r.sock }

// startAgent starts the agent on the rig's socket and state dir and waits until it
// serves.
func (r *rig) startAgent() {
	t := r.t
	t.Helper()
	a := agenttest.Start(t, agenttest.Command{
		Path:        agenttest.Binary(t),
		Args:        append([]string{"agent", "-dev", "-listen", r.address(), "-state-dir", r.state}, r.agentArgs...),
		TempDir:     r.dir,
		MergeOutput: true,
	})
	r.agent = a
	if r.c != nil {
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
		defer cancel()
		if err := r.c.WaitServing(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

func (r *rig) dial() *client.Client {
	t := r.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	c, err := client.Dial(ctx, r.address(), client.WithoutReachCheck(), client.WithBackoff(20*time.Millisecond, 200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.WaitServing(ctx); err != nil {
		t.Fatal(err)
	}
	return c
}

// runningDriver is a Driver in Run.
type runningDriver struct {
	d      *Driver
	cancel context.CancelFunc
	done   chan error
	log    *logtest.Recorder
	once   sync.Once
}

// startDriver runs a Driver (its own client of the agent) on the rig; edit changes
// its config. Cleanup stops it.
func (r *rig) startDriver(edit func(*Config)) *runningDriver {
	t := r.t
	t.Helper()
	agent, err := client.Dial(context.Background(), r.address(), client.WithoutReachCheck(), client.WithBackoff(20*time.Millisecond, 200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	log := &logtest.Recorder{}
	cfg := Config{
		Agent: agent, Kube: r.kube, ResourceREST: resourceREST(t, r.kube), NodeName: testNode, DriverName: testDriver,
		PluginDir: r.pluginDir, RegistryDir: r.registryDir, CDIDir: r.cdiDir,
		Logger: hclog.New(&hclog.LoggerOptions{Output: log, Level: hclog.Debug}),
	}
	if edit != nil {
		edit(&cfg)
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.afterStaleRound = r.staleHook
	d.beforeUpdate = r.updateHook
	ctx, cancel := context.WithCancel(context.Background())
	rd := &runningDriver{d: d, cancel: cancel, done: make(chan error, 1), log: log}
	go func() { rd.done <- d.Run(ctx) }()
	t.Cleanup(func() {
		rd.stop(t)
		agent.Close()
		if t.Failed() {
			t.Logf("driver log:\n%s", log)
		}
	})
	// Run has started the helper once both its sockets answer.
	r.waitSocket(filepath.Join(r.pluginDir, "dra.sock"))
	r.waitSocket(filepath.Join(r.registryDir, testDriver+"-reg.sock"))
	return rd
}

func (rd *runningDriver) stop(t testing.TB) {
	t.Helper()
	rd.once.Do(func() {
		rd.cancel()
		select {
		case err := <-rd.done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(testwait.Timeout):
			t.Error("Run did not return after its context ended")
		}
	})
}

// waitSocket waits until something accepts connections on path.
func (r *rig) waitSocket(path string) {
	t := r.t
	t.Helper()
	deadline := time.Now().Add(testwait.Timeout)
	for {
		c, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("socket %s: %v", path, err)
		}
		time.Sleep(5 * time.Millisecond) // polling a socket coming up: there is no event to wait on
	}
}

// kubelet is a stand-in for the kubelet: the DRA and health services on the
// driver's socket, registration on its registrar socket.
type kubelet struct {
	dra    drapb.DRAPluginClient
	health drahealthpb.DRAResourceHealthClient
	reg    registerpb.RegistrationClient
}

func (r *rig) kubelet() *kubelet {
	t := r.t
	t.Helper()
	conn := func(path string) *grpc.ClientConn {
		c, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	dra := conn(filepath.Join(r.pluginDir, "dra.sock"))
	return &kubelet{
		dra:    drapb.NewDRAPluginClient(dra),
		health: drahealthpb.NewDRAResourceHealthClient(dra),
		reg:    registerpb.NewRegistrationClient(conn(filepath.Join(r.registryDir, testDriver+"-reg.sock"))),
	}
}

func claimReq(c *resourceapi.ResourceClaim) *drapb.Claim {
	return &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}
}

// prepare calls NodePrepareResources for c and returns its claim's answer.
func (k *kubelet) prepare(t testing.TB, c *resourceapi.ResourceClaim) *drapb.NodePrepareResourceResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	resp, err := k.dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{claimReq(c)}})
	if err != nil {
		t.Fatalf("NodePrepareResources: %v", err)
	}
	got := resp.GetClaims()[string(c.UID)]
	if got == nil {
		t.Fatalf("NodePrepareResources: no answer for claim %s: %v", c.UID, resp)
	}
	return got
}

// unprepare calls NodeUnprepareResources for c and returns its claim's error text.
func (k *kubelet) unprepare(t testing.TB, c *resourceapi.ResourceClaim) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	resp, err := k.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{claimReq(c)}})
	if err != nil {
		t.Fatalf("NodeUnprepareResources: %v", err)
	}
	got := resp.GetClaims()[string(c.UID)]
	if got == nil {
		t.Fatalf("NodeUnprepareResources: no answer for claim %s: %v", c.UID, resp)
	}
	return got.GetError()
}

// claim stores an allocated claim for devices (DRA names of this node's pool).
func (r *rig) claim(name string, devices ...string) *resourceapi.ResourceClaim {
	t := r.t
	t.Helper()
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: uuid.NewUUID()}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	// Reserved for its pod, as the scheduler leaves a claim the kubelet prepares.
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: name + "-pod", UID: uuid.NewUUID()}}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpus", Driver: testDriver, Pool: testNode, Device: d})
	}
	// Added to the store, not created through the client: the fake's Create builds a
	// REST mapper each call (3 ms and 1.2 MB of garbage on the test's heap, which the
	// driver shares here and would not share with a real API server).
	if err := r.kube.Tracker().Add(c); err != nil {
		t.Fatal(err)
	}
	return c
}

// waitSlices waits until the pool's published devices satisfy ok, and returns them.
// It follows every stored version of the slices (a watch), so a state that lasts
// only a moment is seen too.
func (r *rig) waitSlices(what string, ok func([]resourceapi.Device) bool) []resourceapi.Device {
	r.t.Helper()
	return r.waitSlicesWithin(testwait.Timeout, what, ok)
}

// waitSlicesWithin is waitSlices, failing the test after timeout.
func (r *rig) waitSlicesWithin(timeout time.Duration, what string, ok func([]resourceapi.Device) bool) []resourceapi.Device {
	t := r.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	w, err := r.kube.ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	list, err := r.kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	stored := make(map[string]resourceapi.ResourceSlice)
	for _, s := range list.Items {
		stored[s.Name] = s
	}
	var devs []resourceapi.Device
	for {
		items := make([]resourceapi.ResourceSlice, 0, len(stored))
		for _, s := range stored {
			items = append(items, s)
		}
		devs = poolDevices(items)
		if ok(devs) {
			return devs
		}
		select {
		case ev := <-w.ResultChan():
			s, isSlice := ev.Object.(*resourceapi.ResourceSlice)
			if !isSlice {
				continue
			}
			if ev.Type == watch.Deleted {
				delete(stored, s.Name)
			} else {
				stored[s.Name] = *s
			}
		case <-ctx.Done():
			var taints []string
			for _, d := range devs {
				taints = append(taints, fmt.Sprintf("%s: %v", d.Name, d.Taints))
			}
			t.Fatalf("published slices: %s: not seen in %v; last: %d devices, taints %v", what, timeout, len(devs), taints)
		}
	}
}

// poolDevices are the devices of the newest complete generation of the node's pool.
func poolDevices(items []resourceapi.ResourceSlice) []resourceapi.Device {
	var gen int64 = -1
	for _, s := range items {
		if s.Spec.Pool.Name == testNode && s.Spec.Driver == testDriver && s.Spec.Pool.Generation > gen {
			gen = s.Spec.Pool.Generation
		}
	}
	var out []resourceapi.Device
	n := 0
	var want int64
	for _, s := range items {
		if s.Spec.Pool.Name == testNode && s.Spec.Pool.Generation == gen {
			out = append(out, s.Spec.Devices...)
			n++
			want = s.Spec.Pool.ResourceSliceCount
		}
	}
	if int64(n) != want {
		return nil
	}
	return out
}

// waitDevices reads the agent's inventory until ok accepts a snapshot.
func (r *rig) waitDevices(what string, ok func(*pb.FingerprintResponse) bool) *pb.FingerprintResponse {
	t := r.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	var last *pb.FingerprintResponse
	for u := range r.c.WatchDevices(ctx) {
		if u.Snapshot != nil {
			last = u.Snapshot
			if ok(u.Snapshot) {
				return u.Snapshot
			}
		}
	}
	t.Fatalf("agent: %s: not seen in %v; last %v", what, testwait.Timeout, last)
	return nil
}

// waitGPUs waits until the agent reports -dev's 8 GPUs and the driver has published
// them, and returns their IDs and group.
func (r *rig) waitGPUs() ([]string, *pb.DeviceGroup) {
	r.t.Helper()
	ids, group := gpus(r.waitDevices("GPUs", func(s *pb.FingerprintResponse) bool { ids, _ := gpus(s); return len(ids) == 8 }))
	r.waitSlices("8 GPUs", func(d []resourceapi.Device) bool { return len(d) == 8 })
	return ids, group
}

// gpus returns the agent's GPU IDs, sorted, and their group.
func gpus(snap *pb.FingerprintResponse) (ids []string, group *pb.DeviceGroup) {
	for _, g := range snap.GetGroups() {
		if g.GetType() == "gpu" {
			for _, d := range g.GetDevices() {
				ids = append(ids, d.GetId())
			}
			return ids, g
		}
	}
	return nil, nil
}

func findDevice(snap *pb.FingerprintResponse, id string) *pb.Device {
	for _, g := range snap.GetGroups() {
		for _, d := range g.GetDevices() {
			if d.GetId() == id {
				return d
			}
		}
	}
	return nil
}

func taintOf(devs []resourceapi.Device, name, key string) (resourceapi.DeviceTaint, bool) {
	for _, d := range devs {
		if d.Name == name {
			for _, tt := range d.Taints {
				if tt.Key == key {
					return tt, true
				}
			}
		}
	}
	return resourceapi.DeviceTaint{}, false
}

// pluginPIDs are the agent's child processes (its plugins).
func pluginPIDs(a *agenttest.Process) []int {
	kids, _ := proc.Children(a.Cmd.Process.Pid)
	var out []int
	for _, p := range kids {
		if !p.Zombie() {
			out = append(out, p.PID)
		}
	}
	return out
}

// newKube is a fake API server holding the node. Like the real one (and unlike the
// fake clientset by itself), it names objects created with only a generateName, as the
// ResourceSlice controller creates them, and gives each object it stores a
// resourceVersion.
func newKube() *fake.Clientset {
	kube := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: testNode, UID: "node-uid-1"}})
	var n atomic.Int64
	kube.PrependReactor("create", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		obj := a.(k8stesting.CreateAction).GetObject()
		m, err := meta.Accessor(obj)
		if err == nil && m.GetName() == "" && m.GetGenerateName() != "" {
			m.SetName(fmt.Sprintf("%s%05d", m.GetGenerateName(), n.Add(1)))
		}
		return false, nil, nil
	})
	// Like the real one, it gives every object it stores a resourceVersion of its own.
	var rv atomic.Int64
	for _, verb := range []string{"create", "update"} {
		kube.PrependReactor(verb, "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if m, err := meta.Accessor(a.(k8stesting.CreateAction).GetObject()); err == nil {
				m.SetResourceVersion(strconv.FormatInt(rv.Add(1), 10))
			}
			return false, nil, nil
		})
	}
	return kube
}

// resourceREST is a REST client of resource.k8s.io/v1 for Config.ResourceREST, served
// by a server that takes ResourceSlice updates (PUT, protobuf, as the publisher
// writes them) into kube's object tracker as the API server would take them, its
// reactors included, and answers with the slice stored (protobuf), or the Status of
// kube's error. Nothing else: the publisher updates through it alone.
func resourceREST(t testing.TB, kube kubernetes.Interface) rest.Interface {
	t.Helper()
	info, ok := runtime.SerializerInfoForMediaType(scheme.Codecs.SupportedMediaTypes(), runtime.ContentTypeProtobuf)
	if !ok {
		t.Fatal("no protobuf serializer")
	}
	codec := scheme.Codecs.CodecForVersions(info.Serializer, info.Serializer, resourceapi.SchemeGroupVersion, resourceapi.SchemeGroupVersion)
	const prefix = "/apis/resource.k8s.io/v1/resourceslices/"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fail := func(err error) {
			st := apierrors.NewBadRequest(err.Error()).Status()
			if s, ok := err.(apierrors.APIStatus); ok {
				st = s.Status()
			}
			st.Kind, st.APIVersion = "Status", "v1"
			data, _ := json.Marshal(st)
			w.Header().Set("Content-Type", runtime.ContentTypeJSON)
			w.WriteHeader(int(st.Code))
			w.Write(data)
		}
		if r.Method != http.MethodPut || !strings.HasPrefix(r.URL.Path, prefix) || r.Header.Get("Content-Type") != runtime.ContentTypeProtobuf {
			fail(apierrors.NewMethodNotSupported(resourceapi.Resource("resourceslices"), r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type")))
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			fail(err)
			return
		}
		s := &resourceapi.ResourceSlice{}
		if err := runtime.DecodeInto(codec, body, s); err != nil {
			fail(err)
			return
		}
		if name := strings.TrimPrefix(r.URL.Path, prefix); s.Name != name {
			fail(fmt.Errorf("the body's name %q is not the path's %q", s.Name, name))
			return
		}
		got, err := kube.ResourceV1().ResourceSlices().Update(r.Context(), s, metav1.UpdateOptions{})
		if err != nil {
			fail(err)
			return
		}
		data, err := runtime.Encode(codec, got)
		if err != nil {
			fail(err)
			return
		}
		w.Header().Set("Content-Type", runtime.ContentTypeProtobuf)
		w.Write(data)
	}))
	t.Cleanup(srv.Close)
	// No rate limit (client-go's default: 5 a second), as the fake clientset has none.
	c, err := rest.RESTClientFor(&rest.Config{Host: srv.URL, APIPath: "/apis", QPS: -1, ContentConfig: rest.ContentConfig{
		GroupVersion: &resourceapi.SchemeGroupVersion, NegotiatedSerializer: scheme.Codecs.WithoutConversion(),
		ContentType: runtime.ContentTypeProtobuf, AcceptContentTypes: runtime.ContentTypeProtobuf}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}
